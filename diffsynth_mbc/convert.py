"""`python -m diffsynth_mbc.convert`: turn an MBC catalogue into DiffSynth metadata (see ``diffsynth_mbc.data.convert``)."""

from diffsynth_mbc.data.convert.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
