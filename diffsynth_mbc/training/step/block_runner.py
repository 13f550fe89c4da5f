"""Running the DiT's blocks: the first N recompute their activations in backward, the rest keep them; each
block optionally ``torch.compile``d.

DiffSynth checkpoints every block or none. Keeping a block's activations costs memory (about 1.25 GiB per
block at 4,400 tokens in bf16) and saves its recomputation (a third of its cost), so on a GPU with room to
spare the fastest plan recomputes only as many blocks as the memory needs (``--gradient_checkpointing N``,
or ``auto`` through the memory model, training/plan/memory.py). Compiling is done in place (``Module.compile``), so the
blocks' parameter names, and with them checkpoints and LoRA files, do not change.

The runner also keeps the largest magnitude any block wrote into the residual stream (one reduction per block, read
once per optimizer step: ``take_largest_residual``): how close the stream comes to fp16's 65,504, said by the status
file and ``doctor --probe``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.utils.checkpoint

DYNAMO_CACHE_LIMIT = 64   # one graph serves the 30 identical blocks; head room for partial batches


class BlockRunner:
    """Calls block ``i`` of the DiT: recomputed in backward when ``i < recompute``, through its compiled form
    when compiling is on. ``offload`` keeps the recomputed blocks' inputs in CPU memory (DiffSynth's offload)."""

    def __init__(self, blocks, recompute: int, offload: bool = False, compile_blocks: bool = False):
        self.blocks = list(blocks)
        self.recompute = max(0, min(int(recompute), len(self.blocks)))
        self.offload = offload
        self.compiled = False
        self.compile_seconds: float | None = None
        self.largest_residual: torch.Tensor | None = None   # since the last take_largest_residual, on the device
        if compile_blocks:
            self.compile()

    def compile(self) -> None:
        import torch._dynamo

        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), DYNAMO_CACHE_LIMIT))
        for block in self.blocks:
            block.compile()
        self.compiled = True

    def give_up_compiling(self, error: BaseException) -> None:
        """A compile failed: say so once and run the blocks as they are from now on."""
        for block in self.blocks:
            block._compiled_call_impl = None
        self.compiled = False
        print(f"note: compiling the DiT blocks failed ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
              "training on uncompiled (--compile off skips the attempt)", file=sys.stderr)

    def __call__(self, index: int, x, context, t_mod, freqs):
        out = self.run_block(index, x, context, t_mod, freqs)
        largest = out.detach().abs().amax().float()   # NaN and inf carry through: an overflow is kept as one
        self.largest_residual = largest if self.largest_residual is None else torch.maximum(self.largest_residual,
                                                                                            largest)
        return out

    def take_largest_residual(self) -> float | None:
        """The largest residual magnitude the blocks wrote since the last call (inf or NaN once one overflowed);
        None when no block ran."""
        largest, self.largest_residual = self.largest_residual, None
        return None if largest is None else float(largest)

    def run_block(self, index: int, x, context, t_mod, freqs):
        block = self.blocks[index]
        if self.compiled and not x.requires_grad and torch.is_grad_enabled():
            # Block 0's input comes from the frozen patch embedding, every later block's from a block with LoRA:
            # the compiled graph guards on requires_grad, and would be compiled twice (block 0, then the rest).
            # As a leaf that asks for its gradient, one graph serves every block; its cost is block 0's input
            # gradient, which is thrown away.
            x = x.detach().requires_grad_()
        if index >= self.recompute:
            return block(x, context, t_mod, freqs)
        if self.offload:
            with torch.autograd.graph.save_on_cpu():
                return torch.utils.checkpoint.checkpoint(block, x, context, t_mod, freqs, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(block, x, context, t_mod, freqs, use_reentrant=False)

    def describe(self) -> str:
        total = len(self.blocks)
        which = ("every block" if self.recompute == total else "no block" if self.recompute == 0
                 else f"the first {self.recompute} of {total} blocks")
        return (f"gradient checkpointing: {which} recompute(s) in backward"
                + (" (inputs offloaded to CPU)" if self.offload and self.recompute else "")
                + ("; blocks compiled" if self.compiled else ""))


class CompileTimer:
    """Says on the terminal that the first steps are compiling, and for how long they took."""

    def __init__(self, enabled: bool, stream=sys.stderr, steps: int = 2):
        self.enabled, self.stream, self.steps = enabled, stream, steps
        self.started = None
        self.seen = 0

    def step_started(self) -> None:
        if not self.enabled or self.seen >= self.steps:
            return
        if self.seen == 0:
            self.started = time.monotonic()
            print("compiling the DiT blocks: the first steps take longer ...", file=self.stream, flush=True)

    def step_finished(self) -> None:
        if not self.enabled or self.seen >= self.steps:
            return
        self.seen += 1
        if self.seen == self.steps:
            print(f"compiled: the first {self.steps} steps took {time.monotonic() - self.started:.1f} s",
                  file=self.stream, flush=True)
