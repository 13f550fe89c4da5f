"""LoRA layers that compute in the base model's dtype while their weights stay fp32.

peft's ``Linear.forward`` casts the layer's input to the LoRA weights' dtype: with fp32 LoRA weights on a bf16
DiT every targeted projection upcasts its 4,400 x 3,072 activations to fp32, and those casts were a fifth of
the GPU time of a full-size step. Here the small A and B matrices are cast to the activations' dtype on each
forward instead; autograd carries the gradients back to the fp32 weights, so AdamW's state, checkpoints and
exported files stay fp32 and updates too small for bf16 (lr 1e-6) are kept.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear


def _computes_plain_lora(layer: LoraLinear, kwargs: dict) -> bool:
    """The case this forward handles: adapters on, not merged, no per-sample adapters, no DoRA-style variant."""
    return not (layer.disable_adapters or layer.merged or kwargs.get("adapter_names") is not None
                or any(name in layer.lora_variant for name in layer.active_adapters))


def forward_in_base_dtype(self: LoraLinear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's LoRA forward (base + B(A(dropout(x))) * scaling) with A and B cast to the base output's dtype."""
    if not _computes_plain_lora(self, kwargs):
        return LoraLinear.forward(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        down = self.lora_A[name].weight.to(result.dtype)
        up = self.lora_B[name].weight.to(result.dtype)
        result = result + F.linear(F.linear(self.lora_dropout[name](x.to(result.dtype)), down), up) * self.scaling[name]
    return result


def compute_lora_in_base_dtype(model: torch.nn.Module) -> int:
    """Give every peft LoRA Linear of ``model`` the base-dtype forward; returns how many layers changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.forward = types.MethodType(forward_in_base_dtype, module)
            changed += 1
    return changed
