"""benchmarks/bench_cache.py runs the training's step at tiny size and prints what it measured; --full-size
refuses without a GPU."""

from __future__ import annotations

import importlib
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # each test starts Python processes that import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cache.py"


def benchmark_module(name: str):
    """benchmarks/NAME.py imported (the benchmarks are scripts, not a package)."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH.parent))


def bench(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **env})


def test_the_tiny_mode_prints_batched_and_one_by_one_images_per_second(tmp_path):
    out = tmp_path / "result.json"
    done = bench("--height", "64", "--width", "64", "--runs", "1", "--steps", "1", "--warmup", "0",
                 "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert re.search(r"case\s+s/step\s+samples/s\s+tokens/s\s+MFU", text), text
    rows = {label: line for label in ("1 video 64x64x17 per forward", "5 images 64x64x1, one per forward",
                                      "5 images 64x64x1 in one forward")
            for line in text.splitlines() if label in line and re.search(r"\d+\.\d{4}", line)}
    assert len(rows) == 3, text
    ratio = re.search(r"images/s: ([\d.]+) with 5 per forward vs ([\d.]+) one per forward: ([\d.]+)x", text)
    assert ratio and all(float(value) > 0 for value in ratio.groups()), text
    assert re.search(r"run by run: [\d.]+x; median [\d.]+x\)", text), text
    assert "flash" in text or "math" in text   # the attention kernel the profiler saw is named
    result = json.loads(out.read_text())
    assert result["images_ratio"]["images_per_forward"] == 5
    assert [row["samples_per_step"] for row in result["rows"]] == [1, 1, 5]


def test_full_size_refuses_without_cuda():
    done = bench("--full-size", CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 2
    assert "--full-size needs a CUDA GPU" in done.stderr and "without --full-size" in done.stderr
    assert done.stdout == ""


def test_the_encode_benchmark_times_the_cache_builders_encoder_per_kind_of_row(tmp_path, capsys):
    bench_encode = benchmark_module("bench_encode")
    out = tmp_path / "encode.json"
    assert bench_encode.main(["--height", "64", "--width", "96", "--num-frames", "5", "--runs", "2", "--warmup", "0",
                              "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["size"], result["height"], result["width"], result["num_frames"]) == ("demo", 64, 96, 5)
    rows = {row["kind"]: row for row in result["rows"]}
    assert list(rows) == ["clip", "image", "caption"] and all(len(row["runs"]) == 2 for row in rows.values())
    # Each kind's figure is the median of its runs (which is faster is the machine's to say: a clip of 5 small
    # frames and an image were 0.109 s and 0.111 s apart on a busy 2-core machine).
    for row in rows.values():
        assert row["seconds"] == pytest.approx(statistics.median(row["runs"]), abs=1e-4) and row["seconds"] > 0
    assert result["video_row_s"] == pytest.approx(rows["clip"]["seconds"] + rows["caption"]["seconds"], abs=1e-4)
    text = capsys.readouterr().out
    assert "clip 96x64x5 (VAE: clip + first frame)" in text and f"{result['video_rows_per_s']:.3f} rows/s" in text
    import torch

    if not torch.cuda.is_available():
        assert bench_encode.main(["--full-size"]) == 2
        assert "--full-size needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_encode.main(["--num-frames", "6"])   # not 4k+1
    assert "--num-frames must be 4k+1" in capsys.readouterr().err


def test_checkpointing_is_read_by_the_trainings_own_rule():
    done = bench("--gradient-checkpointing", "sometimes")
    assert done.returncode == 2 and done.stdout == ""
    assert "--gradient-checkpointing must be all, none, auto or a number of blocks, got 'sometimes'" in done.stderr


def test_the_rows_benchmark_times_every_bucket_stage_and_mode_and_the_evaluations_costs(tmp_path):
    """benchmarks/bench_rows.py at tiny size on this machine: every row of the GPU table on one model, each row's
    warm-up and compiled graphs, and the health record, validation sample and sample clip through the training's
    own code."""
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(BENCH.parent / "bench_rows.py"), "--extras", "--runs", "2", "--steps",
                           "1", "--warmup", "1", "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {row["row"]: row for row in result["rows"]}
    assert list(rows) == ["default", "portrait", "image_batch", "one_image", "square_images", "stage_low",
                          "mixed_modes"]
    assert (rows["portrait"]["shape"], rows["image_batch"]["samples_per_step"], rows["stage_low"]["shape"]) == \
        ("64x128x5", 2, "96x64x5")
    assert rows["mixed_modes"]["modes"] == ["i2v", "t2v"] and rows["mixed_modes"]["memory_step_modes"] in (["i2v"],
                                                                                                         ["t2v"])
    for row in rows.values():
        assert len(row["s_per_step_runs"]) == 2 and row["s_per_step"] > 0 and row["graphs_compiled"] == 0
    extras = result["extras"]
    assert extras["val_quantiles"] == 5 and extras["sample_steps"] == 30 and extras["sample_size"] == "64x64x5"
    assert all(extras[key] > 0 for key in ("health_record_s", "val_sample_s", "val_sample_lora_s", "sample_clip_s"))
    assert extras["val_sample_lora_s"] < extras["val_sample_s"]   # the LoRA's pass is half of LoRA + base
    assert "default" in done.stdout and "sample_clip_s" in done.stdout


def test_the_fp32_residual_benchmark_shows_the_overflow_the_parity_and_what_backward_keeps(tmp_path, capsys):
    bench_fp32_residual = benchmark_module("bench_fp32_residual")
    out = tmp_path / "residual.json"
    assert bench_fp32_residual.main(["--models", "tiny_massive", "--runs", "1", "--json", str(out)]) == 0
    rows = {(row["precision"], row["fp32_residual"]): row for row in json.loads(out.read_text())["results"][0]["rows"]}
    assert not rows[("fp16", False)]["finite"] and rows[("fp16", False)]["largest_residual"] == float("inf")
    assert rows[("fp16", True)]["finite"] and rows[("fp16", True)]["prediction_error"] < 0.005
    assert rows[("fp16", True)]["largest_residual"] > 65504
    for precision in ("fp16", "bf16"):   # the fp32 stream keeps its three norms' inputs in fp32: 2 bytes more each
        kept = {on: rows[(precision, on)]["saved_bytes_per_token_block"] for on in (False, True)}
        extra = kept[True] - kept[False]
        assert 2.5 * 64 * 2 < extra < 3.5 * 64 * 2, extra
    assert "tiny_massive  fp16      model      non-finite non-finite" in capsys.readouterr().out


def test_the_file_checks_benchmark_times_both_ways_to_the_same_answers(tmp_path, capsys):
    """benchmarks/bench_file_checks.py on a few hundred files: the look-ups as they were and as they are answer the
    same (the missing row, every fingerprint) and both are timed."""
    bench_file_checks = benchmark_module("bench_file_checks")
    out = tmp_path / "checks.json"
    assert bench_file_checks.main(["--rows", "300", "--runs", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rows"] == 300 and all(result[key] > 0 for key in ("missing_before", "missing_after", "keys_before",
                                                                        "keys_after"))
    assert "300 files" in capsys.readouterr().out


def test_the_step_profile_names_where_the_host_time_goes_and_reads_the_gpus_work_from_the_trace(tmp_path, capsys):
    profile_step = benchmark_module("profile_step")
    out, traces = tmp_path / "profile.json", tmp_path / "traces"
    assert profile_step.main(["--rows", "one_image", "--runs", "1", "--steps", "2", "--json", str(out),
                              "--traces", str(traces)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["row"] == "one_image" and len(row["per_step"]) == 2 and row["s_per_step"] > 0
    phases = row["mean"]["phases_s"]
    assert phases["forward (the module's loss)"] > 0 and phases["optimizer step"] > 0
    assert "gpu_busy_s" not in row["mean"]   # no GPU here: the host's side alone
    assert any("mm" in op["name"] for op in row["top_host_ops"])
    assert (traces / "profile-one_image.json.gz").stat().st_size > 0
    assert "one_image" in capsys.readouterr().out
    # the GPU's side of a trace: its kernels, copies and fills that start inside each step's window, overlaps once
    trace = {"traceEvents": [
        {"cat": "user_annotation", "name": "profiled step 0", "ts": 0, "dur": 100},
        {"cat": "user_annotation", "name": "profiled step 1", "ts": 100, "dur": 100},
        {"cat": "gpu_user_annotation", "name": "profiled step 0", "ts": 0, "dur": 100},   # not the GPU's work
        {"cat": "kernel", "name": "gemm", "ts": 10, "dur": 30}, {"cat": "kernel", "name": "gemm", "ts": 20, "dur": 30},
        {"cat": "gpu_memcpy", "name": "copy", "ts": 60, "dur": 10},
        {"cat": "kernel", "name": "norm", "ts": 150, "dur": 20}]}
    first, second = profile_step.trace_figures(trace)
    assert first == {"gpu_busy_s": 50e-6, "gpu_idle": 0.5, "kernels": 2}
    assert second == {"gpu_busy_s": 20e-6, "gpu_idle": 0.8, "kernels": 1}
    assert [k["name"] for k in profile_step.top_kernels(trace, 2)] == ["gemm", "norm"]
