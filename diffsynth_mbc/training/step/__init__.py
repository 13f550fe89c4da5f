"""How one training step runs the DiT fast: the LoRA computed in the base dtype, a batch of same-shape samples in
one forward with a timestep and noise per sample, checkpointing of the first N blocks only, compiled blocks.

``lora_cast`` (LoRA layers), ``batch_loss`` (DiffSynth's objective over a batch), ``blocks`` (which blocks
recompute, compiled or not), ``compile_policy`` (whether ``--compile auto`` compiles here; torch-free).
"""
