"""The DiT's residual stream in fp32 while its matmuls and attention run in fp16 or bf16, as Wan2.2's reference
computes it (``--fp32_residual``; the choice: ``training/plan/residual_policy.py``).

The reference (``wan/modules/model.py``, ``WanAttentionBlock.forward``) keeps the time embedding, the AdaLN
modulation and every residual add in fp32, so its residual stream is fp32 from the first block on. DiffSynth 1.1.8's
``DiTBlock.forward`` computes the modulation in the model's dtype and adds the residual in ``x``'s dtype: in fp16
the stream is capped at 65,504, and where a DiT's few channels of very large activations pass it every forward
gives inf/NaN. ``keep_residual_in_fp32(dit)`` gives the DiT's own modules a forward that computes as the reference:

- the time embedding and time projection in fp32 (their weights cast per call), from timesteps in fp32
  (``time_dtype``: the sinusoid ``training/step/batch_loss.py`` embeds);
- in each block: each modulation chunk (the block's parameter + the time projection) in fp32; the norms on the fp32
  stream, in fp32; the modulated inputs cast to the compute dtype (the block's own, that of its weights) for the
  self-attention, cross-attention and FFN; every residual add (the gated self-attention and FFN outputs, the
  cross-attention's) in fp32;
- the head's modulation and norm in fp32, its projection in the compute dtype, its output in the compute dtype (what
  DiffSynth's sampling loop, which calls the same modules, expects).

The LoRA layers are unchanged (``lora_cast``: they compute in the dtype of their input, the compute dtype). The
forwards are set per instance at load, as ``lora_cast`` sets the LoRA's: DiffSynth is not forked, the parameter
names (checkpoints, LoRA files) do not change, and ``Module.compile`` compiles the block with this forward.
Each modulation chunk is its own fp32 tensor, so a block keeps for backward the two gates and the two (1 + scale)
it uses, as DiffSynth keeps the six chunks' one tensor in the model's dtype: the same bytes.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

SHIFT_MSA, SCALE_MSA, GATE_MSA, SHIFT_MLP, SCALE_MLP, GATE_MLP = range(6)   # DiffSynth's order of the 6 chunks


def modulation_chunk(parameter: torch.Tensor, t_mod: torch.Tensor, index: int) -> torch.Tensor:
    """Chunk ``index`` of (the module's modulation parameter (1, n, dim) + the time projection) in fp32: from a
    per-token ``t_mod`` (B, L, n, dim) a (B, L, dim) tensor, from a per-sample one (B, n, dim) a (B, 1, dim)."""
    if t_mod.dim() == 4:
        return parameter[:, index].float() + t_mod[:, :, index].float()
    return parameter[:, index:index + 1].float() + t_mod[:, index:index + 1].float()


def layer_norm_fp32(norm: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm`` computed in fp32 on ``x`` in fp32, its weight and bias (when it has them) cast up."""
    weight = None if norm.weight is None else norm.weight.float()
    bias = None if norm.bias is None else norm.bias.float()
    return F.layer_norm(x.float(), norm.normalized_shape, weight, bias, norm.eps)


def block_forward(self, x, context, t_mod, freqs):
    """``DiTBlock.forward`` with the modulation, the norms and the residual stream in fp32; returns fp32."""
    compute = self.modulation.dtype

    def chunk(index):
        return modulation_chunk(self.modulation, t_mod, index)

    x = x.float()
    attended = self.self_attn((layer_norm_fp32(self.norm1, x) * (1 + chunk(SCALE_MSA)) + chunk(SHIFT_MSA)).to(compute),
                              freqs)
    x = x + attended.float() * chunk(GATE_MSA)
    x = x + self.cross_attn(layer_norm_fp32(self.norm3, x).to(compute), context).float()
    fed = self.ffn((layer_norm_fp32(self.norm2, x) * (1 + chunk(SCALE_MLP)) + chunk(SHIFT_MLP)).to(compute))
    return x + fed.float() * chunk(GATE_MLP)


def head_forward(self, x, t):
    """``Head.forward`` with its modulation and norm in fp32; the projection and the output in the compute dtype.
    ``t`` is the time embedding: per token (B, L, dim) or per sample (B, dim)."""
    compute = self.modulation.dtype
    t = (t if t.dim() == 3 else t.unsqueeze(1)).float()
    shift, scale = (self.modulation[:, index].float().unsqueeze(1) + t for index in range(2))
    return self.head((layer_norm_fp32(self.norm, x) * (1 + scale) + shift).to(compute))


def sequential_forward(self, x):
    """An ``nn.Sequential`` of Linear layers and activations (the time embedding, the time projection) in fp32,
    outside any autocast, the Linear weights cast up per call. Returns fp32."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        x = x.float()
        for layer in self:
            if isinstance(layer, torch.nn.Linear):
                x = F.linear(x, layer.weight.float(), None if layer.bias is None else layer.bias.float())
            else:
                x = layer(x).float()
    return x


def keep_residual_in_fp32(dit) -> int:
    """Give ``dit``'s time embedding, time projection, blocks and head the forwards above; returns the blocks changed.
    Set before the blocks compile (``BlockRunner``) and after the LoRA is injected (its layers are the blocks')."""
    dit.time_embedding.forward = types.MethodType(sequential_forward, dit.time_embedding)
    dit.time_projection.forward = types.MethodType(sequential_forward, dit.time_projection)
    dit.head.forward = types.MethodType(head_forward, dit.head)
    for block in dit.blocks:
        block.forward = types.MethodType(block_forward, block)
    return len(dit.blocks)


def residual_in_fp32(dit) -> bool:
    """Whether ``keep_residual_in_fp32`` was applied to ``dit``."""
    return getattr(dit.head.forward, "__func__", None) is head_forward


def time_dtype(dit, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the timesteps are embedded from: fp32 with the fp32 residual stream, else the model's."""
    return torch.float32 if residual_in_fp32(dit) else model_dtype
