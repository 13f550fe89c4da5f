"""Whether the LoRA is learning: the flags of a ``{"kind": "lora_health"}`` record, decided from the history. No torch.

``health_flags(records, steps, vals, warmup_steps)`` reads the run's health records (oldest first, the newest is the
one being flagged), its step records (``{"step", "loss", "grad_norm", "nonfinite"?}``) and its validation records
(``{"kind": "val", "step", "val_loss", "val_loss_base"?}``), in the shapes the history file holds them, and returns
the flags of the newest record, each ``{"flag", "step", "what", "do"}``:

- ``still``: after the learning-rate warm-up, the largest block update since the first record is below
  ``STILL_MAX_UPDATE`` of the base weights: the learning rate is too low, the targets name no layer that trains,
  or the LoRA is frozen;
- ``exploding``: a block's update grew ``EXPLODE_GROWTH`` times or more between two records after the warm-up, or
  the gradient norm spiked (over ``SPIKE_FACTOR`` times the median of the ``SPIKE_BASELINE`` steps before) at least
  ``SPIKES_TO_FLAG`` times in the last ``SPIKE_WINDOW`` steps;
- ``nonfinite``: steps with an inf/NaN loss or gradient norm since the previous record (the non-finite guard
  already skipped them and stops the run after ``--max_nonfinite_steps`` in a row), or a norm of the record itself
  that is not finite;
- ``overfitting``: over the last ``OVERFIT_VALIDATIONS`` validations that measured the base model too
  (``val_loss_base``), the gain over the base (``val_loss_base - val_loss``) shrank at each one while the
  training loss average (``LOSS_AVERAGE_STEPS`` steps up to each validation) fell.

Every threshold is here, named once; docs/training.md ("LoRA health") lists them with what to do.
"""

from __future__ import annotations

import statistics

from diffsynth_mbc.values import finite_number

# still: the largest block's relative update |dW|_F / |W|_F (summed over the block's LoRA layers) since the first
# record. A LoRA that trains moves by 1e-4 and more within its first steps at learning rates of 1e-5 and up; one
# at 1e-12, or frozen, stays near 1e-11.
STILL_MAX_UPDATE = 1e-6
# exploding: a block's update this many times its previous record's, both after the warm-up (a healthy LoRA's
# update grows about linearly with the steps: at most 2x from one record to the next after the first).
EXPLODE_GROWTH = 100.0
# exploding: a step's gradient norm over SPIKE_FACTOR x the median of the SPIKE_BASELINE steps before it is a spike;
# SPIKES_TO_FLAG of them in the last SPIKE_WINDOW steps flag the record.
SPIKE_FACTOR = 10.0
SPIKE_BASELINE = 20
SPIKE_WINDOW = 100
SPIKES_TO_FLAG = 3
# overfitting: the last this many validations with a base-model loss, the gain over the base shrinking at each.
OVERFIT_VALIDATIONS = 3
# the training loss average at a validation: the mean loss of the steps in (step - LOSS_AVERAGE_STEPS, step].
LOSS_AVERAGE_STEPS = 50
# How many steps of the history the flags ever read back (the spike window and its baseline, the loss average).
STEPS_KEPT = SPIKE_WINDOW + SPIKE_BASELINE + LOSS_AVERAGE_STEPS

FLAGS = ("still", "exploding", "nonfinite", "overfitting")
WHAT_TO_DO = {
    "still": "raise --learning_rate (default 1e-4); check that --lora_target_modules names Linear layers of the "
             "DiT's blocks; check the LoRA trains at all (a resumed or --init_lora run with a frozen LoRA)",
    "exploding": "lower --learning_rate 3-10x, keep --max_grad_norm on (1.0), add --warmup_steps; look at the "
                 "media of the spiking steps",
    "nonfinite": "already guarded: those steps were skipped, and --max_nonfinite_steps of them in a row stop the "
                 "run; lower --learning_rate, prefer bf16 to fp16 (--mixed_precision), look at the media named",
    "overfitting": "keep an earlier LoRA (--save_steps files, checkpoints) or stop sooner (fewer --num_epochs); "
                   "add data, --caption_dropout, or lower --learning_rate or --lora_rank",
}


def flag(name: str, step: int, what: str) -> dict:
    return {"flag": name, "step": step, "what": what, "do": WHAT_TO_DO[name]}


def _norms(record: dict, key: str = "update_norm_by_block") -> list[float | None]:
    return [finite_number(value) for value in record.get(key) or []]


def still(records: list[dict], warmup_steps: int) -> dict | None:
    """The newest record after the warm-up, its largest block update since the first record below the threshold."""
    if len(records) < 2 or records[-1]["step"] <= warmup_steps:
        return None
    first, newest = _norms(records[0]), _norms(records[-1])
    moved = [abs(now - before) for now, before in zip(newest, first) if now is not None and before is not None]
    if not moved or len(moved) != len(newest) or max(moved) >= STILL_MAX_UPDATE:
        return None
    return flag("still", records[-1]["step"],
                f"the largest block update since step {records[0]['step']} is {max(moved):.2g} of the base "
                f"weights, below {STILL_MAX_UPDATE:g}, after the warm-up ({warmup_steps} steps)")


def grown(records: list[dict], warmup_steps: int) -> dict | None:
    """A block whose update grew EXPLODE_GROWTH times or more from the previous record (both after the warm-up)."""
    if len(records) < 2 or records[-2]["step"] <= warmup_steps:
        return None
    before, newest = _norms(records[-2]), _norms(records[-1])
    ratios = [(now / was, block) for block, (now, was) in enumerate(zip(newest, before))
              if now is not None and was is not None and was > 0]
    if not ratios or max(ratios)[0] < EXPLODE_GROWTH:
        return None
    ratio, block = max(ratios)
    return flag("exploding", records[-1]["step"],
                f"block {block}'s update grew {ratio:.3g}x between steps {records[-2]['step']} and "
                f"{records[-1]['step']} (the limit: {EXPLODE_GROWTH:g}x)")


def grad_spikes(steps: list[dict], step: int) -> list[int]:
    """The steps in the last SPIKE_WINDOW up to ``step`` whose gradient norm spiked over their baseline."""
    norms = [(record["step"], finite_number(record.get("grad_norm"))) for record in steps
             if record["step"] <= step and not record.get("nonfinite")]
    norms = [(at, norm) for at, norm in norms if norm is not None]
    spikes = []
    for index, (at, norm) in enumerate(norms):
        if at <= step - SPIKE_WINDOW or index < SPIKE_BASELINE:
            continue
        baseline = statistics.median(value for _, value in norms[index - SPIKE_BASELINE:index])
        if baseline > 0 and norm > SPIKE_FACTOR * baseline:
            spikes.append(at)
    return spikes


def exploding(records: list[dict], steps: list[dict], warmup_steps: int) -> dict | None:
    found = grown(records, warmup_steps)
    if found:
        return found
    spikes = grad_spikes(steps, records[-1]["step"])
    if len(spikes) < SPIKES_TO_FLAG:
        return None
    return flag("exploding", records[-1]["step"],
                f"{len(spikes)} gradient-norm spikes (over {SPIKE_FACTOR:g}x the median of the {SPIKE_BASELINE} "
                f"steps before) in the last {SPIKE_WINDOW} steps, at steps {', '.join(map(str, spikes[-5:]))}")


def nonfinite(records: list[dict], steps: list[dict]) -> dict | None:
    """Steps skipped as non-finite since the previous record, or a norm of the newest record that is not finite."""
    newest = records[-1]
    since = records[-2]["step"] if len(records) > 1 else -1
    bad = [record["step"] for record in steps if since < record["step"] <= newest["step"] and (
        record.get("nonfinite") or (record.get("loss") is not None and finite_number(record.get("loss")) is None))]
    # A norm that is not finite is written as null; a whole grad_norm_by_block of null was not measured (ZeRO-2).
    norms = [*(newest.get("update_norm_by_block") or []), *(newest.get("grad_norm_by_block") or [])]
    bad_norms = sum(finite_number(value) is None for value in norms)
    if not bad and not bad_norms:
        return None
    parts = [f"{len(bad)} step(s) since step {max(since, 0)} had an inf/NaN loss or gradient norm and were "
             f"skipped (steps {', '.join(map(str, bad[-5:]))})"] if bad else []
    if bad_norms:
        parts.append(f"{bad_norms} block norm(s) of this record are not finite")
    return flag("nonfinite", newest["step"], "; ".join(parts))


def train_loss_average(steps: list[dict], step: int) -> float | None:
    """The mean finite loss of the steps in (step - LOSS_AVERAGE_STEPS, step]; None without one."""
    losses = [finite_number(record.get("loss")) for record in steps
              if step - LOSS_AVERAGE_STEPS < record["step"] <= step and not record.get("nonfinite")]
    losses = [loss for loss in losses if loss is not None]
    return sum(losses) / len(losses) if losses else None


def overfitting(vals: list[dict], steps: list[dict], step: int) -> dict | None:
    """The gain over the base shrinking at each of the last validations while the training loss average fell.
    A validation record may carry its own ``train_loss_avg`` (taken when it was made); else it is computed."""
    measured = [val for val in vals if val["step"] <= step and finite_number(val.get("val_loss")) is not None
                and finite_number(val.get("val_loss_base")) is not None]
    last = measured[-OVERFIT_VALIDATIONS:]
    if len(last) < OVERFIT_VALIDATIONS:
        return None
    gains = [val["val_loss_base"] - val["val_loss"] for val in last]
    if any(later >= earlier for earlier, later in zip(gains, gains[1:])):
        return None
    first, newest = (train_loss_average(steps, val["step"]) if finite_number(val.get("train_loss_avg")) is None
                     else val["train_loss_avg"] for val in (last[0], last[-1]))
    if first is None or newest is None or newest >= first:
        return None
    return flag("overfitting", step,
                f"the validation gain over the base model shrank over the last {len(last)} validations (steps "
                f"{', '.join(str(val['step']) for val in last)}: {gains[0]:.4g} -> {gains[-1]:.4g}) while the "
                f"training loss average fell ({first:.4g} -> {newest:.4g})")


def health_flags(records: list[dict], steps: list[dict], vals: list[dict], warmup_steps: int = 0) -> list[dict]:
    """The flags of ``records[-1]`` (see the module's docstring), in the order of FLAGS."""
    if not records:
        return []
    step = records[-1]["step"]
    found = [still(records, warmup_steps), exploding(records, steps, warmup_steps), nonfinite(records, steps),
             overfitting(vals, steps, step)]
    return [item for item in found if item is not None]


def summary(record: dict) -> dict:
    """The status file's ``health``: the newest record's step, its largest block update and gradient norm (with
    their blocks) and its flags."""
    updates, grads = _norms(record), _norms(record, "grad_norm_by_block")
    top = max(((value, block) for block, value in enumerate(updates) if value is not None), default=(None, None))
    top_grad = max(((value, block) for block, value in enumerate(grads) if value is not None), default=(None, None))
    return {"step": record["step"], "max_update_norm": top[0], "max_update_block": top[1],
            "max_grad_norm": top_grad[0], "max_grad_block": top_grad[1], "flags": record.get("flags", []),
            "seconds": record.get("seconds")}
