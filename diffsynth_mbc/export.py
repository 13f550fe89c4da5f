"""`python -m diffsynth_mbc.export`: LoRA files ComfyUI and DiffSynth load (see ``training/lora/export.py``)."""

from diffsynth_mbc.training.lora.export import main

if __name__ == "__main__":
    raise SystemExit(main())
