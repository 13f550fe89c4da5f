"""Whether ``--fp32_residual auto|on|off`` keeps the DiT's residual stream in fp32 for a precision. Pure: no torch.

Wan2.2's reference keeps the time embedding, the AdaLN modulation and every residual add in fp32 whatever the
precision of the matmuls; DiffSynth 1.1.8 computes them in the model's dtype (``training/step/fp32_residual.py``).

- fp16: ``auto`` is on. fp16's range ends at 65,504 and a DiT's residual stream carries a few channels of very large
  activations: DiffSynth's own path turns them into inf, the loss into NaN, and every step is skipped. Loss scaling
  cannot help (it scales the gradients, not the forward).
- bf16: ``auto`` is on too. bf16 has fp32's range, so nothing overflows, but it keeps 8 bits of mantissa: a residual
  add smaller than 1/256 of the stream is rounded away, block after block; Wan2.2's reference keeps the stream in
  fp32 under bf16 as well. Measured on the CPU (``benchmarks/bench_fp32_residual.py``, docs/performance.md, "The fp32
  residual stream"): a 12-block DiT's bf16 prediction 1.6-2.7x and its LoRA gradients 1.6-3.7x closer to fp32's,
  for 8.5% more bytes kept for backward; its time on a GPU is still to be measured.
- fp32 (accelerate's ``no``): nothing to do, the model computes in fp32 already; ``auto`` is off.

``on`` and ``off`` force the choice (``off``: DiffSynth's own forward, as before this existed).
"""

from __future__ import annotations

from dataclasses import dataclass

CHOICES = ("auto", "on", "off")   # --fp32_residual
FP16_MAX = 65504.0   # the largest finite fp16 value


@dataclass(frozen=True)
class ResidualDecision:
    on: bool
    reason: str


def decide_fp32_residual(choice: str, precision: str) -> ResidualDecision:
    """``choice``: auto|on|off; ``precision``: accelerate's value for the run (bf16, fp16 or no)."""
    if choice not in CHOICES:
        raise ValueError(f"--fp32_residual must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "off":
        return ResidualDecision(False, "--fp32_residual off: the time embedding, modulation and residual adds in the "
                                       f"model's dtype (DiffSynth's forward){_fp16_risk(precision)}")
    if precision == "no":
        if choice == "on":
            return ResidualDecision(True, "--fp32_residual on (the model computes in fp32 already: no change)")
        return ResidualDecision(False, "--fp32_residual auto: off under fp32 (the whole model computes in fp32)")
    why = {"fp16": "fp16's range ends at 65,504, which a DiT's largest residual channels pass",
           "bf16": "bf16 rounds away residual adds below 1/256 of the stream"}.get(precision, precision)
    return ResidualDecision(True, f"--fp32_residual {choice}: the time embedding, modulation and residual stream in "
                                  f"fp32, the matmuls and attention in {precision}, as Wan2.2's reference ({why})")


def _fp16_risk(precision: str) -> str:
    return "; under fp16 a residual channel above 65,504 overflows to inf" if precision == "fp16" else ""
