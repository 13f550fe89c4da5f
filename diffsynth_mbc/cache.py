"""`python -m diffsynth_mbc.cache`: encode the latent cache (see ``diffsynth_mbc.data.cache.cli``).

Each rank's status file is written by the training's own status writer, so the monitor reads the cache build and
the training alike (the data package never imports the training's)."""

from diffsynth_mbc.data.cache import cli


def main(argv: list[str] | None = None) -> int:
    from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter

    return cli.main(argv, status_writer=RankStatusWriter)


if __name__ == "__main__":
    raise SystemExit(main())
