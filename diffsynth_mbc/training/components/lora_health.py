"""LoRA health (``--health_steps N``), a component: how far the LoRA has moved each DiT block and how hard its gradients pull, at
the start of the run (step 0), every N optimizer steps and at the end, as ``{"kind": "lora_health"}`` history
records with the flags of ``health_flags.py``; the status file's ``health`` holds the newest record's summary and
rank 0's terminal says each flag, with what to do, the first time it appears.

A block's update is ``sum |dW|_F / |W|_F`` over its LoRA-wrapped Linear layers, ``dW = W' - W`` the change the
LoRA makes to the frozen base weight ``W``:

- LoRA: ``dW = s B A`` (``B``: out x r, ``A``: r x in) and ``|BA|_F^2 = trace((B^T B)(A A^T))``: two r x r
  products, never the out x in matrix; the layers of one shape are measured together in batched products
  (``lora_update_norms``), a few kernels for the whole DiT;
- DoRA: ``W' = m (W + s B A) / |W + s B A|_row`` (``training/lora/variants.py``), so row ``i`` of ``dW`` is
  ``(c_i - 1) W_i + c_i s (BA)_i`` with ``c_i = m_i / |W_i + s (BA)_i|``; its squared norm needs ``|W_i|^2``
  (cached), ``|s (BA)_i|^2`` (from ``A A^T``: r x r) and ``<W_i, s (BA)_i>``, which takes ``W A^T`` (out x r):
  a pass over ``W`` in row chunks, in fp64, exact but costlier than plain LoRA's (``dora_update_norm``).

``|W|_F`` is computed once. Gradient norms per block (``sqrt`` of the sum of the squared gradients of the block's
LoRA weights, before clipping, as the step's ``grad_norm``; one fused norm per tensor as ``clip_grad_norm_`` takes
them) are read on the steps that record, between clipping and ``zero_grad`` (``training/step/micro_batch.py``);
under DeepSpeed the engine has stepped and dropped them
inside ``backward``: ``grad_norm_by_block`` is then null. DDP and ZeRO-2 keep every parameter whole on every
rank, so every rank computes the same record. torch is imported inside the functions.
"""

from __future__ import annotations

import collections
import time

from diffsynth_mbc import run_files
from diffsynth_mbc.run_layout import FINAL_LORA
from diffsynth_mbc.training.components.protocol import Component, StepContext
from diffsynth_mbc.training.evaluation.health_flags import (STEPS_KEPT, WHAT_TO_DO, health_flags, summary,
                                                           train_loss_average)
from diffsynth_mbc.values import finite_number

ROW_CHUNK_ELEMENTS = 1 << 23   # DoRA: rows of W cast to fp64 at a time (64 MB)
CLIP_EPSILON = 1e-6            # torch's clip_grad_norm_: coefficient max_norm / (total + 1e-6)


def lora_update_norms(downs, ups, scales):
    """``|s_k B_k A_k|_F`` of ``n`` layers of one shape at once (fp64, shape ``n``): ``downs`` n x r x in, ``ups``
    n x out x r, ``scales`` n; from the batched ``B^T B`` and ``A A^T`` (n x r x r each)."""
    downs, ups = downs.detach().double(), ups.detach().double()
    grams = (ups.transpose(1, 2) @ ups) * (downs @ downs.transpose(1, 2))
    return scales.abs() * grams.sum((1, 2)).clamp_min(0).sqrt()


def lora_update_norm(down, up, scale: float):
    """``|s B A|_F`` (fp64, 0-dim) of one layer."""
    import torch

    return lora_update_norms(down[None], up[None], torch.tensor([float(scale)], dtype=torch.float64,
                                                                   device=down.device))[0]


def dora_update_norm(weight, down, up, scale: float, magnitude, row_norms):
    """``|W' - W|_F`` (fp64, 0-dim) of a DoRA layer; ``row_norms``: ``|W_i|`` as the layer takes them (the
    magnitudes' dtype, as ``add_dora`` set ``m``), in fp64, so that an untrained DoRA gives exactly 0."""
    import torch

    down, up, magnitude = down.detach().double(), up.detach().double(), magnitude.detach().double()
    gram = down @ down.T
    rows = max(1, ROW_CHUNK_ELEMENTS // weight.shape[1])
    total = torch.zeros((), dtype=torch.float64, device=down.device)
    for start in range(0, weight.shape[0], rows):
        part = slice(start, start + rows)
        up_part, norm2 = up[part], row_norms[part] ** 2
        dot = scale * ((weight[part].detach().double() @ down.T) * up_part).sum(1)     # <W_i, s (BA)_i>
        lora2 = scale * scale * ((up_part @ gram) * up_part).sum(1)                  # |s (BA)_i|^2
        factor = magnitude[part] / (norm2 + 2 * dot + lora2).clamp_min(0).sqrt()   # c_i
        total += ((factor - 1) ** 2 * norm2 + 2 * (factor - 1) * factor * dot + factor ** 2 * lora2).sum()
    return total.clamp_min(0).sqrt()


class LayerNorms:
    """One LoRA-wrapped Linear of a block (one adapter): its base weight's norms, computed once."""

    def __init__(self, module, adapter: str):
        import torch

        self.module, self.adapter = module, adapter
        weight = module.get_base_layer().weight
        dora = getattr(module, "lora_magnitude_vector", None) or {}
        self.magnitude = dora[adapter].weight if adapter in dora else None
        with torch.no_grad():
            self.base_norm = float(torch.linalg.vector_norm(
                weight.detach(), dtype=torch.promote_types(weight.dtype, torch.float32))) or 1.0
            self.row_norms = None if self.magnitude is None else torch.linalg.norm(
                weight.detach().to(self.magnitude.dtype), dim=1).double()

    def weights(self):
        """(A, B): r x in, out x r."""
        return self.module.lora_A[self.adapter].weight, self.module.lora_B[self.adapter].weight

    def scale(self) -> float:
        return float(self.module.scaling[self.adapter])

    def update_norm(self):
        """``|dW|_F`` (fp64, 0-dim tensor)."""
        down, up = self.weights()
        if self.magnitude is None:
            return lora_update_norm(down, up, self.scale())
        return dora_update_norm(self.module.get_base_layer().weight, down, up, self.scale(), self.magnitude,
                                self.row_norms)


def lora_layers(block) -> list[LayerNorms]:
    """Every (LoRA layer, adapter) of one DiT block whose base is a Linear weight."""
    from peft.tuners.lora.layer import LoraLayer

    return [LayerNorms(module, adapter) for module in block.modules() if isinstance(module, LoraLayer)
            for adapter in module.lora_A if module.get_base_layer().weight.ndim == 2]


def update_norms(blocks: list[list[LayerNorms]]) -> list[float | None]:
    """Per block, ``sum |dW|_F / |W|_F`` over its layers (None where it is not finite). Plain LoRA layers of one
    shape are measured together (a few batched products for the whole DiT), DoRA layers one by one; one sync."""
    import torch

    layers = [(block, layer) for block, members in enumerate(blocks) for layer in members]
    if not layers:
        return [0.0] * len(blocks)
    device = layers[0][1].module.lora_A[layers[0][1].adapter].weight.device
    with torch.no_grad():
        norms = torch.zeros(len(layers), dtype=torch.float64, device=device)
        groups: dict[tuple, list[int]] = {}
        for position, (_, layer) in enumerate(layers):
            if layer.magnitude is None:
                down, up = layer.weights()
                groups.setdefault((tuple(down.shape), tuple(up.shape), down.dtype), []).append(position)
            else:
                norms[position] = layer.update_norm()
        for members in groups.values():
            pairs = [layers[position][1].weights() for position in members]
            scales = torch.tensor([layers[position][1].scale() for position in members], dtype=torch.float64,
                                  device=device)
            norms[members] = lora_update_norms(torch.stack([down for down, _ in pairs]),
                                               torch.stack([up for _, up in pairs]), scales)
        bases = torch.tensor([layer.base_norm for _, layer in layers], dtype=torch.float64, device=device)
        ratios = (norms / bases).cpu().tolist()
    sums = [0.0] * len(blocks)
    for (block, _), ratio in zip(layers, ratios):
        sums[block] += ratio
    return [_rounded(value) for value in sums]


def grad_norms(blocks: list[list], grad_norm, max_norm: float) -> list[float | None] | None:
    """Per block, the norm of its LoRA weights' gradients before clipping (``grad_norm``: the step's total, before
    clipping, ``max_norm``: the clipping's); None when no gradient is there (DeepSpeed)."""
    import math

    import torch

    if not any(parameter.grad is not None for parameters in blocks for parameter in parameters):
        return None
    total = finite_number(grad_norm)
    unclip = max(1.0, (total + CLIP_EPSILON) / max_norm) if total is not None and math.isfinite(max_norm) else 1.0
    grads = [(block, parameter.grad.detach()) for block, parameters in enumerate(blocks) for parameter in parameters
             if parameter.grad is not None]
    with torch.no_grad():   # one fused norm per dtype and device (as clip_grad_norm_), one copy to the host
        norms = torch.stack([norm.double() for norm in torch._foreach_norm([grad for _, grad in grads])]).cpu().tolist()
    squares = [0.0] * len(blocks)
    for (block, _), norm in zip(grads, norms):
        squares[block] += norm * norm
    return [_rounded(math.sqrt(value) * unclip) for value in squares]


def _rounded(value: float) -> float | None:
    """Six significant digits, None when not finite (the history is strict JSON)."""
    number = finite_number(value)
    return None if number is None else float(f"{number:.6g}")


class LoraHealth(Component):
    """The run's health records: at the start (step 0, or a resume's step, kept in memory only: its history, cut back
    to that step, has its records), on the steps that record (their gradient norms read in ``on_gradients``),
    and at the end (after the last validation), where a broken LoRA fails the run. Off (every call does nothing)
    with ``every`` 0."""

    name = "lora_health"

    def __init__(self, blocks, status, printer, *, every: int, total_steps: int, warmup_steps: int,
                 read_grads: bool = True, accelerator=None, trainable=()):
        self.every, self.total_steps, self.warmup_steps = every, total_steps, warmup_steps
        self.status, self.printer, self.read_grads = status, printer, read_grads
        self.accelerator, self.trainable = accelerator, list(trainable)
        self.steps: collections.deque[dict] = collections.deque(maxlen=STEPS_KEPT)
        self.vals: collections.deque[dict] = collections.deque(maxlen=16)
        self.records: list[dict] = []     # the first record, then the newest two (what the flags read back)
        self.pending: tuple[int, list | None, float] | None = None   # (step, gradient norms, seconds)
        self.shown: set[str] = set()
        self.layers = [lora_layers(block) for block in blocks] if every else []
        self.parameters = [[p for p in block.parameters() if p.requires_grad] for block in blocks] if every else []
        if every:
            status.history_listeners.append(self.saw)

    def at_start(self, context: StepContext) -> None:
        self.record(context.step, write=context.step == 0)

    def on_gradients(self, step: int, grad_norm, max_norm: float) -> None:
        self.read_gradients(step, grad_norm, max_norm)

    def after_step(self, context: StepContext) -> None:
        """Every ``every`` steps; the last step's record waits for ``at_end`` (after the last validation)."""
        step = context.step
        if self.every and step % self.every == 0 and step != self.total_steps:
            self.record(step)

    def at_end(self, context: StepContext) -> None:
        """The last record (after the last validation: the overfitting flag reads it), then ``end_of_run``."""
        self.record_last(context.step)
        self.end_of_run(context.step)

    def record_last(self, step: int) -> None:
        """The record of the run's last step, unless it has one."""
        if self.every and not (self.records and self.records[-1]["step"] == step):
            self.record(step)

    def saw(self, record: dict) -> None:
        """Every history record as it is written: the steps' losses and gradient norms, the validations."""
        kind = record.get("kind")
        if kind is None and "step" in record:
            self.steps.append({key: record.get(key) for key in ("step", "loss", "grad_norm", "nonfinite")})
        elif kind == "val":
            self.vals.append({"step": record["step"], "val_loss": record.get("val_loss"),
                              "val_loss_base": record.get("val_loss_base"),
                              "train_loss_avg": train_loss_average(list(self.steps), record["step"])})

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.total_steps)

    def read_gradients(self, step: int, grad_norm, max_norm: float) -> None:
        """On a step that records (``step``: the one about to be taken), the blocks' gradient norms."""
        if self.due(step) and self.read_grads:
            start = time.perf_counter()
            self.pending = (step, grad_norms(self.parameters, grad_norm, max_norm), time.perf_counter() - start)

    def record(self, step: int, write: bool = True) -> dict | None:
        """The record at ``step``: flagged, appended to the history, summarised in the status file; without
        ``write`` only kept as the first record the flags compare with (a resumed run's starting point, whose
        history already holds the records up to it)."""
        if not self.every:
            return None
        start = time.perf_counter()
        updates = update_norms(self.layers)
        grads, grad_seconds = (self.pending[1], self.pending[2]) if self.pending and self.pending[0] == step \
            else (None, 0.0)
        record = {"kind": run_files.HEALTH_RECORD, "step": step, "update_norm_by_block": updates,
                  "grad_norm_by_block": grads, "flags": [],
                  "seconds": round(time.perf_counter() - start + grad_seconds, 6), "time": round(time.time(), 3)}
        self.records = [*self.records[:1], *self.records[1:][-1:], record]
        if not write:
            return record
        record["flags"] = health_flags(self.records, list(self.steps), list(self.vals), self.warmup_steps)
        self.status.append_history(record)
        self.status.update(health=summary(record))
        for found in record["flags"]:
            if found["flag"] not in self.shown:
                self.shown.add(found["flag"])
                self.printer.event(f"LoRA health at step {step}: {found['flag']}: {found['what']}. "
                                   f"What to do: {found['do']}")
        return record

    def end_of_run(self, step: int) -> None:
        """On every rank alike, the run fails, naming why, instead of publishing ``lora.safetensors``, when a LoRA
        tensor holds inf/NaN (also with the records off), or the last record flags ``exploding``, or it flags
        ``nonfinite`` and the last step was skipped as non-finite too (the LoRA no longer gives a finite loss).
        Non-finite steps followed by finite ones changed no weight and fail nothing here (``--max_nonfinite_steps``
        in a row stop the run)."""
        import torch

        from diffsynth_mbc.training.distributed.collectives import all_reduce_sum

        last = self.records[-1] if self.records else {}
        ends_skipped = bool(self.steps and self.steps[-1].get("nonfinite"))   # the last step's history record
        broken = [found for found in last.get("flags") or [] if found["flag"] == "exploding"
                  or (found["flag"] == "nonfinite" and ends_skipped)]
        nonfinite = sum(1 for parameter in self.trainable if not bool(torch.isfinite(parameter.detach()).all()))
        local = torch.tensor([1 if broken or nonfinite else 0], device=self.accelerator.device)
        if int(all_reduce_sum(self.accelerator, local, self.status,
                              "ranks in all-reduce (the LoRA's health at the end)").item()) == 0:
            return
        if nonfinite:
            why = f"{nonfinite} of the {len(self.trainable)} LoRA tensors hold inf or NaN at step {step}"
        elif broken:
            why = "; ".join(f"LoRA health at step {last['step']}: {found['flag']}: {found['what']}"
                            for found in broken)
        else:
            why = "another rank found its LoRA broken (its status file says why)"
        raise UnhealthyRunError(f"the run ended with a broken LoRA ({why}); {FINAL_LORA} is not written "
                                "(checkpoints and epoch files, if any, hold earlier weights). What to do: "
                                f"{WHAT_TO_DO['exploding']}")


class UnhealthyRunError(RuntimeError):
    """The run ended with a broken LoRA: its last health record flags it, or its weights hold inf/NaN."""
