"""What evaluation adds to a run's projected length: validations, LoRA health records and sample clips, from the
costs measured on the H100 box (benchmarks/results/2026-11-28-h100.json), counted as the training does them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffsynth_mbc.sample_prompts import SamplePrompt
from diffsynth_mbc.training.options import DEFAULTS
from diffsynth_mbc.training.options.run_options import TrainOptions
from diffsynth_mbc.training.plan import evaluation_cost as cost
from diffsynth_mbc.training.plan.evaluation_cost import due_count, evaluation_cost, health_cadence

H100_TABLE = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "2026-11-28-h100.json"


def options(**changes) -> TrainOptions:
    return TrainOptions(**{**DEFAULTS, "height": 704, "width": 1280, "num_frames": 17, **changes})


def test_the_constants_are_the_measured_extras():
    extras = json.loads(H100_TABLE.read_text())["extras"]
    assert cost.VAL_SAMPLE_LORA_S == pytest.approx(extras["val_sample_lora_s"], rel=0.01)
    assert cost.VAL_SAMPLE_LORA_S + cost.VAL_SAMPLE_BASE_S == pytest.approx(extras["val_sample_s"], rel=0.01)
    assert cost.HEALTH_RECORD_S == pytest.approx(extras["health_record_s"], rel=0.01)
    assert cost.HEALTH_RECORD_DORA_S == pytest.approx(extras["health_record_dora_s"], rel=0.01)
    assert cost.SAMPLE_CLIP_S == pytest.approx(extras["sample_clip_s"], rel=0.01)
    assert (extras["sample_size"], extras["sample_steps"], extras["val_quantiles"]) == ("1280x704x17", 30, 5)


def test_counts_follow_the_training_every_n_steps_and_at_the_end():
    assert due_count(10, 4, False) == 3            # steps 4, 8 and the end (10)
    assert due_count(8, 4, False) == 2             # the end is step 8 already
    assert due_count(8, 4, True) == 3              # and step 0
    assert due_count(8, None, False) == 1          # only at the end
    assert due_count(0, 4, True) == 1


def test_dora_records_every_100_steps_unless_asked_and_0_turns_them_off():
    assert health_cadence(options()) == 10 and health_cadence(options(lora_variant="dora")) == 100
    assert health_cadence(options(lora_variant="dora", health_steps=10)) == 10
    assert health_cadence(options(health_steps=0)) == 0


def test_the_full_presets_evaluation_on_an_h100_and_scaled():
    run = options(val_metadata_path="val.csv", val_steps=2000, val_samples=64)
    on_h100 = evaluation_cost(run, 245_000, 2, 1.0, 1.0)
    assert (on_h100.validations, on_h100.val_samples_per_gpu, on_h100.health_records) == (123, 32, 24_501)
    assert on_h100.validation_seconds == pytest.approx(32 * 0.578)
    assert on_h100.validation_total == pytest.approx(123 * 32 * 0.578 + 32 * 0.528)
    assert on_h100.health_total == pytest.approx(24_501 * 0.029) and on_h100.samples_total == 0
    assert on_h100.seconds == pytest.approx(on_h100.validation_total + on_h100.health_total)
    slower = evaluation_cost(run, 245_000, 2, 7.6, 3.0)
    assert slower.validation_total == pytest.approx(7.6 * on_h100.validation_total)
    assert slower.health_total == pytest.approx(3.0 * on_h100.health_total)
    assert "123 validation(s) x 32 sample(s) per GPU" in slower.line() and "24,501 LoRA health record(s)" in slower.line()
    assert evaluation_cost(options(health_steps=0), 245_000, 2, 1.0, 1.0).line() is None


def test_sample_clips_are_rendered_by_rank_0_at_their_size_steps_and_strengths():
    prompts = [SamplePrompt("a", seed=1, height=704, width=1280, num_frames=17),
               SamplePrompt("b", seed=2, height=704, width=1280, num_frames=17, steps=15, cfg_scale=1.0)]
    run = options(sample_prompts="prompts.yaml", sample_steps=1000, sample_strengths="0,1", health_steps=0)
    clips = evaluation_cost(run, 2500, 2, 1.0, 1.0, prompts)
    assert (clips.sample_sets, clips.clips_per_set, clips.base_clips) == (4, 2, 2)   # steps 0, 1000, 2000, 2500
    assert clips.clip_seconds == pytest.approx((7.77 + 7.77 / 2 / 2) / 2)
    assert clips.seconds == pytest.approx((4 * 2 + 2) * clips.clip_seconds)
    assert "4 sample set(s) x 2 clip(s) + 2 of the base" in clips.line()


def test_the_plan_says_the_validation_keeps_the_best_and_may_end_the_run_early():
    run = options(val_metadata_path="val.csv", val_steps=2000, val_samples=64)
    assert evaluation_cost(run, 245_000, 2, 1.0, 1.0).best_line() == (
        "validation every 2,000 steps keeps the best LoRA (lora-best.safetensors); --early_stop N would end the run "
        "after N validations without improving")
    early = evaluation_cost(run.replace(early_stop=5), 245_000, 2, 1.0, 1.0)
    assert early.best_line() == ("the run may end early: it stops after 5 validation(s) in a row without a 0.10% "
                                 "improvement, validating every 2,000 steps; the best LoRA is kept "
                                 "(lora-best.safetensors)")
    assert early.as_dict()["ends_early"] is True
    stricter = evaluation_cost(run.replace(early_stop=5, early_stop_min_delta=0.01), 245_000, 2, 1.0, 1.0)
    assert "without a 1.00% improvement" in stricter.best_line()   # --early_stop_min_delta, as the validation reads it
    assert evaluation_cost(options(), 245_000, 2, 1.0, 1.0).best_line() is None   # nothing validated


def test_in_stages_the_plan_says_the_early_stop_counts_in_the_final_stage_only():
    run = options(val_metadata_path="val.csv", val_steps=10, early_stop=3, resolution_stages="832x480:0.6")
    assert evaluation_cost(run, 420, 2, 1.0, 1.0).best_line() == (   # stage 1: steps 1-252, the final: 253-420
        "the run may end early: it stops after 3 validation(s) in a row without a 0.10% improvement, validating "
        "every 10 steps, counted in the final stage only (from step 253: the validations before it count for "
        "nothing); the best LoRA is kept (lora-best.safetensors, with the stage that trained it)")


def test_the_full_preset_stops_early_and_its_projection_says_up_to(tmp_path):
    from diffsynth_mbc.training.options import resolve_options
    from diffsynth_mbc.training.plan import run_length

    preset = resolve_options(["--config", str(Path(__file__).resolve().parents[3] / "configs" / "train_full.yaml")])
    assert preset.early_stop == 5 and preset.early_stop_min_delta == 0.001
    from diffsynth_mbc.training.plan.step_plan import plan_from_options

    plan = plan_from_options(preset, rows=170_180, images=90_000, world_size=2)
    shape = run_length.RunShape(plan, 1, "GPU")
    projection = run_length.project(shape, 3.0, 1.9, None, None, kind="estimate",
                                    evaluation=evaluation_cost(preset, shape.total_steps, 2, 7.9, 3.7))
    assert projection.line().startswith("projected run length: up to ")
    assert projection.as_dict()["best_line"].startswith("the run may end early: it stops after 5 validation(s)")
