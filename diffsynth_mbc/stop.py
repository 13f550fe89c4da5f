"""`python -m diffsynth_mbc.stop OUTPUT_PATH [--grace S]`: stop a run (see ``diffsynth_mbc.training.run_control``)."""

from diffsynth_mbc.training.run_control import main

if __name__ == "__main__":
    raise SystemExit(main())
