"""What a run's evaluation adds to its length (pure Python, no torch): validations, LoRA health records and sample
clips, whose count grows with the run's steps.

Measured at full size on one H100 80GB (2026-11-28, torch 2.11.0+cu130, ``benchmarks/bench_rows.py --full-size
--extras``, benchmarks/results/2026-11-28-h100.json), on the module a run trains (compiled blocks, bf16), through
the training's own code:

    one validation sample (1280x704x17) at the 5 quantiles, with the LoRA (``Validator.measure``)    0.578 s
    the same sample with the LoRA off (the base: once per process, at its first validation)          0.528 s
    one LoRA health record (the blocks' gradient and update norms)                                   0.029 s
    one DoRA health record (exact norms: the base weights read in fp64 row chunks)                   0.441 s
    one 1280x704x17 sample clip, 30 denoising steps with CFG 5 (60 DiT forwards + the VAE decode)    7.77 s

Other sizes scale by the forward's FLOPs (``speed.work``), other step and quantile counts linearly, other GPUs by
the tensor-rate ratio (the health records, a pass over weights, by the bandwidth ratio where it is lower). The
first validation and the first sample clip of a process also compile the blocks' no-grad graphs (about 18 and
9 s on the H100, once): not counted. Each rank validates its share of the samples and waits for the others; rank
0 renders the sample clips while the others wait, so a clip costs every GPU its time.
"""

from __future__ import annotations

import dataclasses
import math

from diffsynth_mbc.run_layout import BEST_LORA

from diffsynth_mbc.training.plan import memory, speed

# --health_steps when not given: a DoRA record (0.441 s) every 10 steps of 0.305 s would be 14% of an H100 run;
# every 100 it is 1.4%, a LoRA record (0.029 s) every 10 about 1%
HEALTH_STEPS = {"lora": 10, "dora": 100}
VAL_SAMPLE_LORA_S = 0.578
VAL_SAMPLE_BASE_S = 0.528
VAL_QUANTILES = 5
HEALTH_RECORD_S = 0.029
HEALTH_RECORD_DORA_S = 0.441
SAMPLE_CLIP_S = 7.77
SAMPLE_CLIP_STEPS = 30


@dataclasses.dataclass(frozen=True)
class EvaluationCost:
    """Counts over the run and seconds of one of each (per GPU, wall time)."""
    validations: int
    val_samples_per_gpu: int
    validation_seconds: float     # one validation on one GPU (its share of the samples, every weight set)
    base_seconds: float           # the base model's pass, once per process
    health_records: int
    health_record_seconds: float
    sample_sets: int
    clips_per_set: int
    clip_seconds: float
    base_clips: int               # strength 0: once per prompt
    val_every: int | None = None  # --val_steps
    early_stop: int | None = None     # --early_stop N: the run may end after N validations without improving
    min_delta: float = 0.0

    @property
    def validation_total(self) -> float:
        return self.validations * self.validation_seconds + (self.base_seconds if self.validations else 0.0)

    @property
    def health_total(self) -> float:
        return self.health_records * self.health_record_seconds

    @property
    def samples_total(self) -> float:
        return (self.sample_sets * self.clips_per_set + self.base_clips) * self.clip_seconds

    @property
    def seconds(self) -> float:
        return self.validation_total + self.health_total + self.samples_total

    def parts(self) -> list[str]:
        from diffsynth_mbc.training.plan.run_length import duration

        parts = []
        if self.validations:
            parts.append(f"{self.validations:,} validation(s) x {self.val_samples_per_gpu} sample(s) per GPU "
                         f"x {self.validation_seconds:.0f} s + the base once ({self.base_seconds:.0f} s) = "
                         f"{duration(self.validation_total)}")
        if self.health_records:
            parts.append(f"{self.health_records:,} LoRA health record(s) x {self.health_record_seconds:.2f} s = "
                         f"{duration(self.health_total)}")
        if self.sample_sets:
            parts.append(f"{self.sample_sets:,} sample set(s) x {self.clips_per_set} clip(s)"
                         + (f" + {self.base_clips} of the base" if self.base_clips else "")
                         + f" x {self.clip_seconds:.0f} s = {duration(self.samples_total)}")
        return parts

    def best_line(self) -> str | None:
        """What the validation does besides measuring: keep the best LoRA, and with --early_stop end the run sooner
        (``it stops after 3 validations without a 0.1% improvement, every 2,000 steps``)."""
        if not self.validations:
            return None
        every = f"every {self.val_every:,} steps" if self.val_every else "at the end"
        if self.early_stop is None:
            return (f"validation {every} keeps the best LoRA ({BEST_LORA}); --early_stop N would end the "
                    "run after N validations without improving")
        return (f"the run may end early: it stops after {self.early_stop} validation(s) in a row without a "
                f"{self.min_delta:.2%} improvement, validating {every}; the best LoRA is kept ({BEST_LORA})")

    def line(self) -> str | None:
        from diffsynth_mbc.training.plan.run_length import duration

        parts = self.parts()
        if not parts:
            return None
        return f"evaluation: {duration(self.seconds)} over the run (estimate): " + "; ".join(parts)

    def as_dict(self) -> dict:
        return {"seconds": round(self.seconds), "validation_seconds": round(self.validation_total),
                "health_seconds": round(self.health_total), "samples_seconds": round(self.samples_total),
                "validations": self.validations, "health_records": self.health_records,
                "sample_sets": self.sample_sets, "line": self.line(), "early_stop": self.early_stop,
                "best_line": self.best_line()}


def health_cadence(options) -> int:
    """Optimizer steps between LoRA health records: ``--health_steps``, else the variant's default (0: off)."""
    if options.health_steps is not None:
        return options.health_steps
    return HEALTH_STEPS[options.lora_variant]


def due_count(total_steps: int, every: int | None, at_start: bool) -> int:
    """How many times something due every ``every`` steps and at the end happens (and at step 0 with ``at_start``)."""
    if not every:
        return 1 if total_steps else 0
    return total_steps // every + (1 if total_steps % every else 0) + (1 if at_start else 0)


def evaluation_cost(options, total_steps: int, gpus: int, tensor_ratio: float, bandwidth_ratio: float,
                    prompts: list | None = None) -> EvaluationCost:
    """The evaluation of a run of ``total_steps`` optimizer steps per GPU on ``gpus`` GPUs; ``prompts``: its sample
    prompts (``SamplePrompt``s), None without ``--sample_prompts``."""
    validations = due_count(total_steps, options.val_steps, False) if options.val_metadata_path else 0
    tokens = memory.tokens(options.height, options.width, options.num_frames)
    per_sample = speed.work(tokens) * tensor_ratio
    quantiles = len(str(options.val_timestep_quantiles).split(",")) / VAL_QUANTILES
    share = math.ceil(options.val_samples / max(1, gpus)) if validations else 0
    weight_sets = 2 if options.validate_with == "both" and options.ema_decay else 1
    validation = share * VAL_SAMPLE_LORA_S * quantiles * per_sample * weight_sets
    base = share * VAL_SAMPLE_BASE_S * quantiles * per_sample
    health = health_cadence(options)
    records = due_count(total_steps, health, True) if health else 0
    record = HEALTH_RECORD_DORA_S if options.lora_variant == "dora" else HEALTH_RECORD_S
    sets, clips, base_clips, clip = 0, 0, 0, 0.0
    if prompts:
        from diffsynth_mbc.sample_prompts import parse_strengths

        strengths = parse_strengths(options.sample_strengths)
        sets = due_count(total_steps, options.sample_steps, bool(options.sample_steps))
        clips = len(prompts) * len([s for s in strengths if s != 0]) * weight_sets
        base_clips = len(prompts) if 0 in strengths else 0
        clip = sum(SAMPLE_CLIP_S * p.steps / SAMPLE_CLIP_STEPS * (1.0 if p.cfg_scale != 1 else 0.5)
                   * speed.work(memory.tokens(p.height, p.width, p.num_frames)) for p in prompts) / len(prompts)
        clip *= tensor_ratio
    return EvaluationCost(validations, share, validation, base, records, record * max(1.0, bandwidth_ratio),
                          sets, clips, clip, base_clips, val_every=options.val_steps,
                          early_stop=options.early_stop if validations else None,
                          min_delta=options.early_stop_min_delta)
