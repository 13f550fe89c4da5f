"""`python -m diffsynth_mbc.demo`: the built-in demo's data (see ``diffsynth_mbc.data.demo``)."""

from diffsynth_mbc.data.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
