"""``python -m diffsynth_mbc.sample``: render a run's LoRA files side by side with the base model and validate
them (``cli.py``)."""
