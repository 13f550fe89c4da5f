"""`python -m diffsynth_mbc.train`: LoRA training, started by accelerate launch (see ``diffsynth_mbc.training.cli``)."""

if __name__ == "__main__":   # the collector waits until the training is set up (lifecycle/startup.py)
    from diffsynth_mbc.lifecycle.startup import pause_collector

    pause_collector()

from diffsynth_mbc.training.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
