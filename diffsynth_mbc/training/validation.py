"""Validation loss on a fixed subset with a fixed seed per sample, so values compare over time."""

from __future__ import annotations

import time

from diffsynth_mbc.training.distributed import all_reduce_sum
from diffsynth_mbc.training.status_writer import RankStatusWriter


class Validator:
    """Validation loss on a fixed subset, with a fixed seed per sample, so values compare over time.

    Each rank takes every world_size-th sample of the subset; the RNG of training is left untouched.
    """

    def __init__(self, options, status: RankStatusWriter):
        from diffsynth_mbc.data.cache.dataset import open_validation_dataset

        self.status = status
        self.seed = options.seed + 7919
        self.dataset = open_validation_dataset(options, substitute_bad_media=True)
        self.indices = list(range(min(options.val_samples, self.dataset.rows)))
        self.accelerator = self.module = None

    def attach(self, accelerator, module) -> None:
        self.accelerator, self.module = accelerator, module

    def run(self, step: int) -> float | None:
        import torch

        self.status.update(phase=f"validation at step {step}")
        model = self.accelerator.unwrap_model(self.module)
        mine = self.indices[self.accelerator.process_index::self.accelerator.num_processes]
        total = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for index in mine:
                torch.manual_seed(self.seed + index)   # same noise and timestep for this sample every time
                sample = self.dataset[index]
                sample.pop("skipped", None)
                with self.accelerator.autocast():
                    total[0] += model.sample_loss(sample).double()
                total[1] += 1
        total = all_reduce_sum(self.accelerator, total)
        if total[1] == 0:
            return None
        val_loss = float(total[0] / total[1])
        self.status.append_history({"kind": "val", "step": step, "val_loss": val_loss, "val_samples": int(total[1]),
                                    "time": round(time.time(), 3)})
        self.status.update(val_loss=val_loss, val_step=step, phase=f"validated at step {step}")
        return val_loss
