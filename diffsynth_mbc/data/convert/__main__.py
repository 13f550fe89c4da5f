"""`python -m diffsynth_mbc.data.convert`, the same command as ``python -m diffsynth_mbc.convert``."""

from diffsynth_mbc.data.convert.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
