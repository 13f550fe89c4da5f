"""The LoRA: the training module, DoRA/LoRA+ variants, file formats, reading, export, ``--init_lora``, EMA, and
the LoRA files a run writes."""
