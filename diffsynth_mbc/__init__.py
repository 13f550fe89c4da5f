"""diffsynth-mbc: LoRA fine-tuning of Wan2.2-TI2V-5B on the MBC archive through DiffSynth-Studio."""

__version__ = "0.1.0"
