"""`python -m diffsynth_mbc.monitor`: watch a run (see ``diffsynth_mbc.monitor.cli``)."""

from diffsynth_mbc.monitor.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
