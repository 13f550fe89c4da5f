"""The per-step features of a training run, each a component that owns its state (``protocol.py``): the best LoRA
and the early stop, resolution stages, the EMA, LoRA health, sample clips, the guards against bad media and
non-finite steps, the checkpoint schedule, stop requests, step LoRA files and the step's progress report."""
