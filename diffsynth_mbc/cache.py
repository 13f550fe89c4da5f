"""`python -m diffsynth_mbc.cache`: encode the latent cache (see ``diffsynth_mbc.data.cache.cli``)."""

from diffsynth_mbc.data.cache.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
