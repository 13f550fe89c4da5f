"""How many DiT blocks recompute their activations in backward: ``--gradient_checkpointing``. Pure Python.

``all`` (every block; DiffSynth's checkpointing), ``none``, ``N`` (the first N), or ``auto``: the fewest
that the doctor's memory model fits under 90% of the GPU's memory (``doctor.memory``), every block where
there is no GPU to size it for.
"""

from __future__ import annotations


def recompute_blocks(choice: str, num_blocks: int, auto_blocks: int | None = None) -> tuple[int, str]:
    """(blocks that recompute, why). ``auto_blocks``: the memory model's answer for this GPU, None without one."""
    choice = str(choice).strip().lower()
    if choice == "all":
        return num_blocks, "--gradient_checkpointing all"
    if choice == "none":
        return 0, "--gradient_checkpointing none"
    if choice == "auto":
        if auto_blocks is None:
            return num_blocks, "--gradient_checkpointing auto: every block (no GPU memory to size it for)"
        blocks = max(0, min(int(auto_blocks), num_blocks))
        return blocks, (f"--gradient_checkpointing auto: {blocks} of {num_blocks} blocks recompute, the fewest "
                        "that the memory model fits under 90% of this GPU")
    if choice.isdigit():
        if int(choice) > num_blocks:
            raise ValueError(f"--gradient_checkpointing {choice}: the DiT has {num_blocks} blocks")
        return int(choice), f"--gradient_checkpointing {choice}"
    raise ValueError(f"--gradient_checkpointing must be all, none, auto or a number of blocks, got {choice!r}")
