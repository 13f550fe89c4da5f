"""Validation loss on a fixed subset, at fixed timestep quantiles, with a fixed seed per sample.

The same samples, the same noise and the same timesteps every time: two evaluations differ only by
the LoRA. The headline ``val_loss`` is the mean over the quantiles; each quantile's loss is kept too. Each sample
is measured in the training's objective and in a mode fixed for the run (an image t2i, a video i2v or t2v as
``--i2v_probability`` chooses, ``training/step/objective.py``); ``val_loss_by_mode`` is the mean per mode.

Against the base: every record also carries the base model's loss (the LoRA off, scale 0: ``lora_disabled`` of
``training/lora/module.py``) on the same samples, timesteps and noise, ``val_loss_base`` (with ``_by_quantile``
and ``_by_mode``). The base never changes, so it is measured once, at this process's first validation, and kept in
memory (``Validator.base``) for every later one; a resumed run measures it again at its first validation (the same
numbers: the same samples, seeds and timesteps). ``val_loss_base_step`` is the step whose validation measured it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from diffsynth_mbc.training.distributed.accelerator import unwrapped_model
from diffsynth_mbc.training.distributed.collectives import all_reduce_sum
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter


SUBSTITUTED_NAMED = 10   # rows a validation record names of those it could not decode
# What a validation's figures depend on besides the weights: two measures made with the same of these compare.
MEASURED_WITH = ("val_metadata_path", "val_base_path", "val_cache", "val_samples", "val_timestep_quantiles", "seed",
                 "height", "width", "num_frames", "buckets")


def validation_settings(options) -> dict:
    """``MEASURED_WITH`` of ``options``, as a run's record holds them (``python -m diffsynth_mbc.sample --validate``
    keeps each file's figures with them, and measures again when they change)."""
    values = options.recorded()
    return {key: values[key] for key in MEASURED_WITH}


def settings_text(settings: dict) -> str:
    """``validation at 64x64x9: 4 samples of val/metadata.csv, timestep quantiles 0.1,0.5,0.9, seed 42`` of
    ``validation_settings``."""
    source = settings["val_metadata_path"] or settings["val_cache"]
    return (f"validation at {settings['width']}x{settings['height']}x{settings['num_frames']}: "
            f"{settings['val_samples']} samples of {source}, timestep quantiles {settings['val_timestep_quantiles']}, "
            f"seed {settings['seed']}")


@dataclass
class Validation:
    """One validation, measured: its history ``record`` and its status ``fields``, until ``Validator.write``."""
    step: int
    val_loss: float
    record: dict
    fields: dict

    def mark(self, **fields) -> None:
        """What a component says of this validation (``new_best``), in the record and the status alike."""
        self.record.update(fields)
        self.fields.update(fields)


class Validator:
    """Each rank takes every world_size-th sample of the subset; the RNG of training is left untouched.

    With ``--validate_with ema`` the headline ``val_loss`` is the EMA's (``val_weights: "ema"``); with ``both`` it
    is the raw weights' and the EMA's is ``val_loss_ema`` (and ``val_loss_ema_by_quantile``) beside it."""

    def __init__(self, options, status: RankStatusWriter):
        from diffsynth_mbc.data.cache.dataset import open_validation_dataset

        self.status = status
        self.seed = options.seed + 7919
        self.dataset = open_validation_dataset(options, substitute_bad_media=True)
        self.indices = list(range(min(options.val_samples, self.dataset.rows)))
        self.quantiles = list(options.val_timestep_quantiles)
        self.validate_with = options.validate_with
        self.objective, self.i2v_probability = options.objective, options.i2v_probability
        self.accelerator = self.module = None
        # The base model's (by_quantile, by_mode, samples), measured once (the first validation of this process)
        self.base: tuple[dict, dict, int] | None = None
        # The rows the last measure_losses() could not decode and took the next row for: (this rank's, every rank's count)
        self.substituted: tuple[list[dict], int] = ([], 0)
        self.base_step = 0
        self.every = options.val_steps
        self.ema = None   # the run's LoraEma (--validate_with ema|both measure it)

    def attach(self, accelerator, module, ema=None) -> None:
        """The trained module, once accelerate has prepared it, and the EMA of its LoRA."""
        self.accelerator, self.module, self.ema = accelerator, module, ema

    def due(self, step: int) -> bool:
        """Every ``--val_steps`` optimizer steps (and at the run's end, unless it just did)."""
        return bool(self.every) and step % self.every == 0

    def measure(self, step: int) -> "Validation | None":
        """The validation of ``step`` (every rank calls it: the measurement is split and all-reduced), not yet
        written: the components may add to it (``Validation.mark``) before ``write``. None without samples."""
        from diffsynth_mbc.training.lora.ema import weights_for

        self.status.update(phase=f"validation at step {step}")
        which = weights_for(self.validate_with, self.ema.updates) if self.ema is not None else ["raw"]
        measured = {}
        for weights in which:
            with self.ema.weights(weights) if self.ema is not None else contextlib.nullcontext():
                measured[weights] = self.measure_losses()
        by_quantile, by_mode, samples = measured[which[0]]
        if samples == 0:
            return None
        val_loss = sum(by_quantile.values()) / len(by_quantile)
        extra = {"val_weights": "ema"} if which == ["ema"] else {}
        if "ema" in which and which[0] != "ema":
            ema_by_quantile, ema_by_mode, _ = measured["ema"]
            extra = {"val_loss_ema": sum(ema_by_quantile.values()) / len(ema_by_quantile),
                     "val_loss_ema_by_quantile": ema_by_quantile, "val_loss_ema_by_mode": ema_by_mode}
        extra.update(self.base_fields(step))
        # said, not hidden: samples whose own row did not decode were the next rows (every rank's count; the rows
        # this rank took over, named)
        mine, substituted = self.substituted
        said = {"val_substituted": substituted, "val_substituted_rows": mine[:SUBSTITUTED_NAMED]}
        record = {"kind": "val", "step": step, "val_loss": val_loss, "val_loss_by_quantile": by_quantile,
                  "val_loss_by_mode": by_mode, "val_samples": samples, "time": round(time.time(), 3), **extra,
                  **(said if substituted else {})}
        fields = {"val_loss": val_loss, "val_loss_by_quantile": by_quantile, "val_loss_by_mode": by_mode,
                  "val_step": step, "phase": f"validated at step {step}", "new_best": False, **extra, **said}
        return Validation(step, val_loss, record, fields)

    def write(self, validation: "Validation") -> None:
        """The validation's history record and status fields."""
        self.status.append_history(validation.record)
        self.status.update(**validation.fields)

    def base_fields(self, step: int) -> dict:
        """``val_loss_base`` (mean over the quantiles), ``_by_quantile``, ``_by_mode`` and ``val_loss_base_step``:
        the base model (the LoRA off) on the same samples, noise and timesteps, measured at the first call and
        kept (the base does not change). Every rank calls it: the measurement is split and all-reduced."""
        if self.base is None:
            with unwrapped_model(self.accelerator, self.module).lora_disabled():
                self.base = self.measure_losses()
            self.base_step = step
        by_quantile, by_mode, samples = self.base
        if not samples:
            return {}
        return {"val_loss_base": sum(by_quantile.values()) / len(by_quantile), "val_loss_base_by_quantile": by_quantile,
                "val_loss_base_by_mode": by_mode, "val_loss_base_step": self.base_step}

    def mode(self, sample: dict, index: int) -> str:
        from diffsynth_mbc.training.step.objective import validation_mode
        from diffsynth_mbc.training.step.micro_batch import latent_frames

        return validation_mode(self.objective, self.i2v_probability, latent_frames(sample) == 1, self.seed, index)

    def measure_losses(self) -> tuple[dict, dict, int]:
        """({quantile: mean loss}, {mode: mean loss}, samples) over every rank's share of the subset, with the
        weights as they are. A sample's loss in its mode is its mean over the quantiles."""
        import torch

        from diffsynth_mbc.training.step.objective import MODES

        model = unwrapped_model(self.accelerator, self.module)
        mine = self.indices[self.accelerator.process_index::self.accelerator.num_processes]
        quantiles, modes = len(self.quantiles), len(MODES)
        # per quantile: sum of losses; per mode: sum of the samples' losses, then samples; then samples; last: the
        # samples that were another row, their own not decoding
        total = torch.zeros(quantiles + 2 * modes + 2, dtype=torch.float64, device=self.accelerator.device)
        substituted = []
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for index in mine:
                sample = self.dataset[index]
                skipped = sample.pop("skipped", None) or []
                substituted += [{**record, "val_sample": index} for record in skipped]
                total[-1] += bool(skipped)
                sample["mode"] = self.mode(sample, index)
                torch.manual_seed(self.seed + index)   # the same noise for this sample at every validation
                with self.accelerator.autocast():
                    inputs = model.inputs(dict(sample))   # encoded once (VAE, text encoder), the noise drawn once
                for position, quantile in enumerate(self.quantiles):
                    with self.accelerator.autocast():
                        loss = model.inputs_loss(inputs, timestep_quantile=quantile).double()
                    total[position] += loss
                    total[quantiles + MODES.index(sample["mode"])] += loss / quantiles
                total[quantiles + modes + MODES.index(sample["mode"])] += 1
                total[-2] += 1
        total = all_reduce_sum(self.accelerator, total, self.status, "ranks in all-reduce (validation loss)")
        samples = int(total[-2])
        self.substituted = (substituted, int(total[-1]))
        if samples == 0:
            return {}, {}, 0
        by_mode = {mode: float(total[quantiles + m] / total[quantiles + modes + m]) for m, mode in enumerate(MODES)
                   if total[quantiles + modes + m] > 0}
        return {f"{q:g}": float(total[i] / samples) for i, q in enumerate(self.quantiles)}, by_mode, samples
