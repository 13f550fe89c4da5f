"""`python -m diffsynth_mbc.export`: LoRA files ComfyUI and DiffSynth load (see ``diffsynth_mbc.training.export``)."""

from diffsynth_mbc.training.export import main

if __name__ == "__main__":
    raise SystemExit(main())
