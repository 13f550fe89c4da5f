"""`python -m diffsynth_mbc.plan`: print a training's step plan (see ``diffsynth_mbc.training.plan.command``)."""

from diffsynth_mbc.training.plan.command import main

if __name__ == "__main__":
    raise SystemExit(main())
