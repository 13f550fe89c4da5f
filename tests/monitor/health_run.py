"""A crafted 2-rank run with what issue #30's dashboard panels read: validation records with the base model's loss,
LoRA health records with flags, and status files with the recipe, the health summary and each catalogue's progress
(the schema of diffsynth_mbc.run_files and training/reporting/recipe.py)."""

from __future__ import annotations

import json
import math
import time

import monitor_fixtures as F

STEPS = 120
VAL_EVERY = 30
HEALTH_EVERY = 10
BLOCKS = 30
QUANTILES = ("0.1", "0.5", "0.9")
FLAGGED_STEP = 110   # the record that raises the flags (the newest health record's are in the status files)
STILL = {"flag": "still", "step": STEPS, "what": "the largest block update since step 0 is 4e-11 of the base weights, "
         "below 1e-06, after the warm-up (2 steps)", "do": "raise --learning_rate; check that --lora_target_modules "
         "names Linear layers of the blocks"}
OVERFIT = {"flag": "overfitting", "step": STEPS, "what": "the gain over the base shrank at each of the last 3 "
           "validations while the training loss fell", "do": "keep an earlier LoRA (--save_steps files) or stop sooner"}
RECIPE = {
    "objective": "modes", "i2v_probability": 0.5, "size": {"height": 704, "width": 1280, "num_frames": 17},
    "buckets": "aspect", "frames": {"sampling": "uniform", "source_fps": None, "short_clips": "pad"},
    "timestep_sampling": {"method": "logit_normal", "logit_mean": 0.0, "logit_std": 1.0},
    "loss_weighting": "none",
    "lora": {"variant": "dora", "rank": 32, "alpha": 16, "target_modules": "q,k,v,o,ffn.0,ffn.2",
             "loraplus_lr_ratio": None, "init_lora": None},
    "learning_rate": 0.0001, "lr_scheduler": "cosine", "ema": {"decay": 0.999, "warmup": 100, "validate_with": "both"},
    "captions": {"dropout": 0.05, "prefix": "", "suffix": ""},
    "catalogues": [{"name": "news", "metadata_path": "/data/catalogues/news/metadata.csv", "repeat": 2},
                   {"name": "drama", "metadata_path": "/data/catalogues/drama-series-with-a-long-name/metadata.csv",
                    "repeat": 1, "caption_prefix": "drama: "},
                   {"name": "stills", "metadata_path": "/data/catalogues/stills/metadata.csv", "repeat": 3,
                    "media": "images"}],
}
CATALOGUES = {0: [("news", 41, 60), ("drama", 12, 35), ("stills", 70, 70)],
              1: [("news", 38, 60), ("drama", 15, 35), ("stills", 66, 70)]}


def val_loss(step, quantile):
    return round(0.2 + float(quantile) / 2 - step / 4000, 6)


def base_loss(quantile):
    return round(0.22 + float(quantile) / 2 + float(quantile) ** 2 / 20, 6)


def update_norm(step, block):
    """0 at step 0, then growing with the step, larger in the middle blocks; block 7 is not finite at step 50."""
    if step == 0:
        return 0.0
    if (step, block) == (50, 7):
        return None
    return float(f"{1e-5 * step * (1 + 20 * math.exp(-((block - 15) / 6) ** 2)):.6g}")


def health_record(step):
    flags = [dict(STILL, step=step)] if step == FLAGGED_STEP else []
    return {"kind": "lora_health", "step": step, "update_norm_by_block": [update_norm(step, b) for b in range(BLOCKS)],
            "grad_norm_by_block": None if step == 0 else [round(0.1 + b / 100, 6) for b in range(BLOCKS)],
            "flags": flags, "seconds": 0.002, "time": F.NOW + step}


def validation_record(step):
    by_quantile = {q: val_loss(step, q) for q in QUANTILES}
    base = {q: base_loss(q) for q in QUANTILES}
    return {"kind": "val", "step": step, "val_loss": sum(by_quantile.values()) / 3, "val_loss_by_quantile": by_quantile,
            "val_loss_base": sum(base.values()) / 3, "val_loss_base_by_quantile": base, "val_loss_base_step": VAL_EVERY,
            "val_samples": 8, "time": F.NOW + step}


def history_lines(rank, steps):
    """The records of ``steps`` as the training writes them: the step, then its validation and health record."""
    lines = []
    for step in steps:
        if step:
            lines.append(F.history_line(step, rank, grad_norm=0.5, samples=2))
        if step and step % VAL_EVERY == 0:
            lines.append(json.dumps(validation_record(step)) + "\n")
        if step % HEALTH_EVERY == 0:
            lines.append(json.dumps(health_record(step)) + "\n")
    return "".join(lines)


def write_health_run(log_dir, steps=STEPS):
    now = time.time()
    for rank in (0, 1):
        F.write_raw(log_dir / f"training_gpu{rank}.jsonl", history_lines(rank, range(0, steps + 1)))
        F.write_status(log_dir, rank, world_size=2, step=steps, total_steps=1000, now=now, recipe=RECIPE,
                       health={"step": steps, "max_update_norm": update_norm(steps, 15), "max_update_block": 15,
                               "max_grad_norm": 0.39, "max_grad_block": 29,
                               "flags": [STILL] + ([OVERFIT] if rank == 0 else []), "seconds": 0.002},
                       catalogue_progress=[{"name": n, "seen": seen, "per_epoch": per}
                                           for n, seen, per in CATALOGUES[rank]],
                       val_loss_base=sum(base_loss(q) for q in QUANTILES) / 3, val_loss_base_step=VAL_EVERY)
