"""The speed model: the H100 step times it is built on come back as measured, the rest says how it was derived."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from diffsynth_mbc.gpu import known_gpu
from diffsynth_mbc.training.plan import speed
from diffsynth_mbc.training.plan.memory import Plan

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
ENCODE_ON_H200 = BENCHMARKS / "results" / "2026-11-26-h200-encode" / "encode_bf16.json"
H100 = known_gpu("H100-80GB")
AS_BUILT = Plan(704, 1280, 17, precision="bf16", attention="cudnn", cached=True, lora_dtype="fp32")
DEFAULTS = AS_BUILT.but(lora_dtype="base", compiled=True)   # the training's defaults on an H100
MEASURED = [   # 1280x704x17, batch 1, from the cache, seconds per step on one H100 80GB
    (AS_BUILT, 0.77), (AS_BUILT.but(attention="mem_efficient"), 0.95), (AS_BUILT.but(attention="math"), 1.91),
    (AS_BUILT.but(recomputed_blocks=0), 0.51), (AS_BUILT.but(lora_dtype="base"), 0.55), (DEFAULTS, 0.39),
    (DEFAULTS.but(recomputed_blocks=0), 0.27), (DEFAULTS.but(precision="fp16", attention="mem_efficient"), 0.57),
]


def on(plan, gpu="H100-80GB", accumulation=1):
    return speed.seconds_per_step(plan, known_gpu(gpu), gpu, accumulation)


@pytest.mark.parametrize("plan, seconds", MEASURED)
def test_the_h100_measurements_come_back_labelled_measured(plan, seconds):
    """The GPU's part of each step measured on the first H100 box; where the 2026-11-28 H100 box's host floor is above
    it (two of them: every block recomputed in bf16), the step is the host's, an estimate that says so."""
    step = on(plan)
    assert step.sources[0].endswith("s measured")
    host, box = speed.host_seconds(plan, "H100-80GB")
    if host <= seconds:
        assert step.seconds == pytest.approx(seconds) and step.measured and step.as_dict()["kind"] == "measured"
    else:
        assert step.seconds == pytest.approx(host) and not step.measured and box == "H100-80GB"
        assert any(source.startswith(f"host-bound: the CPU's {host:.2f} s") for source in step.sources)


def test_the_flop_convention_and_the_mfu_of_the_table():
    assert speed.step_flops(4400) == 1.56e14
    assert on(AS_BUILT).mfu == pytest.approx(0.20, abs=0.01) and on(DEFAULTS.but(recomputed_blocks=0)).mfu == \
        pytest.approx(0.59, abs=0.01)
    assert 0.14 < speed.attention_share() < 0.17                     # self-attention's share at 4,400 tokens
    assert speed.work(880) == pytest.approx(0.2 * (1 - speed.attention_share()) + 0.04 * speed.attention_share())
    assert 0.85 < speed.work(880, 5) < 0.9                            # five images: a bit less than one clip


def test_the_one_image_step_and_encoding_every_step_are_reproduced():
    one_image = on(AS_BUILT.but(num_frames=1))   # the first H100 box measured 0.61 s: host-bound there too
    assert one_image.seconds == pytest.approx(0.61, rel=0.10) and not one_image.measured
    assert on(AS_BUILT.but(cached=False)).seconds == pytest.approx(1.44, rel=0.01)


def test_the_cache_build_reproduces_the_encodes_measured_on_the_h200():
    measured = json.loads(ENCODE_ON_H200.read_text())
    assert (measured["device"], measured["size"], measured["dtype"], measured["text_len"]) == \
        ("NVIDIA H200", "full", "bf16", 512)
    clip = Plan(measured["height"], measured["width"], measured["num_frames"])
    assert speed.cache_encode_seconds(clip) == pytest.approx(measured["video_row_s"], rel=0.02)
    assert speed.cache_encode_seconds(clip.but(num_frames=1)) == pytest.approx(measured["image_row_s"], rel=0.05)
    quarter = clip.but(height=352, width=640)   # a quarter of the pixels: the VAE's part shrinks, the caption's not
    assert speed.cache_encode_seconds(quarter) == pytest.approx(speed.CACHE_VAE_FRAME_S * 18 / 4 + speed.CACHE_CAPTION_S)
    assert speed.cache_encode_seconds(clip, tensor_ratio=7.6) == pytest.approx(7.6 * speed.cache_encode_seconds(clip))


def test_recomputed_blocks_interpolate_between_every_block_and_none():
    halfway = on(DEFAULTS.but(recomputed_blocks=15), "H200-141GB")   # the H200 box's host is below its GPU part
    assert halfway.seconds == pytest.approx((0.39 + 0.27) / 2) and not halfway.measured
    assert "derived from every block recomputed 0.39 s (measured) and none 0.27 s (measured)" in halfway.sources[0]
    eager_none = on(DEFAULTS.but(compiled=False, recomputed_blocks=0))   # not measured: the eager none/all ratio
    assert eager_none.seconds == pytest.approx(0.55 * 0.51 / 0.77)


def test_other_gpus_are_scaled_by_tensor_rate_and_bandwidth_and_labelled_estimates():
    v100s_path = DEFAULTS.but(precision="fp16", attention="mem_efficient", recomputed_blocks=17)
    step = on(v100s_path, "V100S-32GB")
    tensor, bandwidth = speed.gpu_ratios(known_gpu("V100S-32GB"), "fp16")
    assert tensor == pytest.approx(7.6, abs=0.05) and bandwidth == pytest.approx(3.0, abs=0.1)
    assert not step.measured and "scaled to V100S-32GB: tensor rate 7.6x lower, bandwidth 3.0x lower" in step.sources[-1]
    h100 = on(v100s_path)
    assert 3 * h100.seconds < step.seconds < 7.6 * h100.seconds
    # the H200 has the H100's tensor rate and 1.43x its bandwidth, and measured the first H100 box's step times; the
    # H100 box of 2026-11-28 had a slower host, whose floor is above the GPU's part with every block recomputed
    assert on(DEFAULTS, "H200-141GB").seconds == pytest.approx(0.39)
    assert on(DEFAULTS).seconds == pytest.approx(speed.host_seconds(DEFAULTS, "H100-80GB")[0])
    assert on(DEFAULTS).seconds > 0.39
    assert "taken as no faster" in on(DEFAULTS, "H200-141GB").sources[-1]
    assert on(DEFAULTS).seconds < on(DEFAULTS.but(attention="flash"), "A100-80GB").seconds
    # bf16 on a V100 is emulated on the CUDA cores and its attention takes the math kernel: far slower
    assert on(DEFAULTS.but(attention="math"), "V100-32GB").seconds > 10 * step.seconds
    assert speed.seconds_per_step(DEFAULTS, known_gpu("H100-80GB").__class__("B200", (10, 0), 180, None, None),
                                  None) is None


def test_accumulation_multiplies_the_optimizer_step():
    assert on(DEFAULTS, accumulation=4).seconds == pytest.approx(4 * on(DEFAULTS).seconds)
    assert on(DEFAULTS, accumulation=4).flops == pytest.approx(4 * 1.56e14)


@pytest.fixture(scope="module")
def gpu_results():
    """benchmarks/gpu_results.py: the raw GPU results read beside the doctor's figures."""
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_results

    return gpu_results


def test_the_model_is_within_ten_percent_of_every_clip_and_image_batch_step_measured_on_the_h200(gpu_results):
    """benchmarks/results/2026-11-26-h200: full-size TI2V-5B steps on an H200, recomputed with today's model."""
    rows = gpu_results.table_rows(BENCHMARKS / "results" / "2026-11-26-h200", "H200-141GB")
    assert {row["case"] for row in rows} >= {"default", "image_batch", "recompute_all", "v100_analog"}
    for row in rows:   # one image per forward (--image_batch_size 1, a partial batch) is the host's: 20%
        bound = 0.20 if row["case"].endswith("one_image") else 0.10
        assert row["doctor_s_per_step"] == pytest.approx(row["s_per_step"], rel=bound), row["case"]


def test_the_model_is_within_20_percent_and_the_memory_within_15_of_every_row_measured_on_the_h100_box(gpu_results):
    """benchmarks/results/2026-11-28-h100: every bucket, image batch, stage and mode row, recomputed with today's
    model (the committed table is what gpu_results.py wrote from the same raw files)."""
    folder = BENCHMARKS / "results" / "2026-11-28-h100"
    rows = gpu_results.table_rows(folder, "H100-80GB")
    assert {row["case"] for row in rows} >= {"default", "image_batch", "one_image", "portrait", "square_images",
                                             "stage_low", "mixed_modes"}
    for row in rows:
        assert row["doctor_s_per_step"] == pytest.approx(row["s_per_step"], rel=0.20), row["case"]
        assert row["doctor_peak_gib"] == pytest.approx(row["peak_gib"], rel=0.15), row["case"]
    committed = json.loads(folder.with_suffix(".json").read_text())
    assert [row["case"] for row in committed["rows"]] == [row["case"] for row in rows]
    assert [row["s_per_step"] for row in committed["rows"]] == [row["s_per_step"] for row in rows]
    assert set(committed["extras"]) >= {"health_record_s", "health_record_dora_s", "val_sample_s", "sample_clip_s",
                                        "compile_warmup_s", "recompiles"}


def test_a_raw_file_whose_rows_ran_other_settings_than_its_name_says_is_refused(gpu_results, tmp_path):
    folder = tmp_path / "raw"
    folder.mkdir()
    for name in gpu_results.RUNS:
        (folder / name).write_bytes((BENCHMARKS / "results" / "2026-11-26-h200" / name).read_bytes())
    (folder / "recompute_none.json").write_bytes((folder / "recompute_all.json").read_bytes())
    with pytest.raises(SystemExit, match=r"recompute_none.json, row '1 video 1280x704x17 per forward'.*; 0/30 blocks"):
        gpu_results.table_rows(folder, "H200-141GB")
