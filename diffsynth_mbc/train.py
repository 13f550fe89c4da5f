"""`python -m diffsynth_mbc.train`: LoRA training, started by accelerate launch (see ``diffsynth_mbc.training.cli``)."""

from diffsynth_mbc.training.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
