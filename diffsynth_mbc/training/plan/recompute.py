"""How many DiT blocks recompute their activations in backward: ``--gradient_checkpointing``. Pure Python.

``all`` (every block; DiffSynth's checkpointing), ``none``, ``N`` (the first N), or ``auto``: the fewest
that the memory model fits under 90% of the GPU's memory (``training/plan/memory.py``), every block where
there is no GPU to size it for. The option is read here only: the options' check, the training and the doctor
all ask ``parse_choice`` and ``recompute_blocks``.
"""

from __future__ import annotations

from diffsynth_mbc.errors import OptionsError, quoted


def recompute_blocks(choice: str, num_blocks: int, auto_blocks: int | None = None) -> tuple[int, str]:
    """(blocks that recompute, why). ``auto_blocks``: the memory model's answer for this GPU, None without one."""
    choice = parse_choice(choice)
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
    if choice > num_blocks:
        raise OptionsError(f"--gradient_checkpointing {choice}: the DiT has {num_blocks} blocks")
    return choice, f"--gradient_checkpointing {choice}"


def parse_choice(value) -> str | int:
    """``all``, ``none``, ``auto`` or a number of blocks; an OptionsError naming the flag for anything else."""
    choice = str(value).strip().lower()
    if choice in ("all", "none", "auto"):
        return choice
    if choice.isdigit():
        return int(choice)
    raise OptionsError(f"--gradient_checkpointing must be all, none, auto or a number of blocks, got {quoted(value)}")
