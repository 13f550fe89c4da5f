"""The latent cache command on real demo media: resume after SIGKILL, keys, failures, 2 ranks, training checks."""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.data.cache import cli as cache
from diffsynth_mbc.data.cache.dataset import (CachedLatentDataset, CacheMismatchError, open_training_dataset,
                                              open_validation_dataset)
from diffsynth_mbc.data.cache.index import CacheError
from diffsynth_mbc.data.dataset import MBCVideoDataset
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.training.options import TrainOptions
from e2e_helpers import isolated_env
from forked_ranks import CACHE_BUILD, run_training

ROWS, BROKEN_ROW = 6, 3                     # 4 videos + 2 images; video_002 (metadata row 3) is unreadable
GOOD_ROWS = ROWS - 1


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-demo")
    metadata = prepare(root, num_videos=4, num_images=2)
    (root / "catalog" / "media" / "video_002.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video" * 8)
    return root, metadata


def flags(root, cache_dir, height=64, *extra):
    return ["--demo", "--dataset_base_path", str(root / "catalog"), "--dataset_metadata_path",
            str(root / "metadata" / "metadata.csv"), "--height", str(height), "--width", "64", "--num_frames", "9",
            "--cache_dir", str(cache_dir), "--dataset_num_workers", "0", *extra]


def run_in_process(root, cache_dir, height=64, *extra) -> dict:
    assert cache.main(flags(root, cache_dir, height, *extra)) == 0
    return json.loads((Path(cache_dir) / "summary.json").read_text())


def entry_files(cache_dir) -> list[Path]:
    return sorted(p for p in (Path(cache_dir) / "entries").rglob("*.safetensors"))


def all_tensors(cache_dir) -> dict:
    files = sorted(Path(cache_dir).glob("entries/*/*.safetensors")) + sorted(Path(cache_dir).glob("text/*/*.safetensors"))
    return {str(p.relative_to(cache_dir)): load_file(str(p)) for p in files}


def assert_same_cache(first, second):
    """The same entries under the same keys and the same index; tensors equal to float rounding.

    What resume and a rebuild rely on is the keys (file fingerprint + settings) and the index, which must
    match exactly. The values come from the encoders' float sums, whose order depends on the CPU and on
    the thread count (a cache built by 2 ranks of 1 thread is not bit-equal to one built by 1 process of
    2 threads), so they are compared within fp32 rounding of the encoders' outputs, not bit for bit."""
    a, b = all_tensors(first), all_tensors(second)
    assert a.keys() == b.keys() and len(a) == 2 * GOOD_ROWS + 1   # + the empty prompt's embedding, once
    for name in a:
        assert a[name].keys() == b[name].keys()
        for key in a[name]:
            assert a[name][key].dtype == b[name][key].dtype and a[name][key].shape == b[name][key].shape
            torch.testing.assert_close(a[name][key], b[name][key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
    index_a, index_b = (json.loads((Path(d) / "cache.json").read_text()) for d in (first, second))
    assert index_a == index_b


@pytest.fixture(scope="module")
def reference(demo, tmp_path_factory):
    """One uninterrupted single-process run."""
    root, _ = demo
    cache_dir = tmp_path_factory.mktemp("reference") / "cache"
    return cache_dir, run_in_process(root, cache_dir)


def test_first_run_encodes_every_row_and_lists_the_corrupt_clip(demo, reference):
    cache_dir, summary = reference
    assert (summary["written"], summary["skipped"], summary["failed"]) == (GOOD_ROWS, 0, 1)
    assert summary["text_written"] == GOOD_ROWS and summary["rows_cached"] == GOOD_ROWS
    assert summary["bytes"] == sum(p.stat().st_size for p in cache_dir.rglob("*.safetensors"))
    stats = summary["per_rank"][0]   # when its first and last encoded rows were done: the probe's encode rate
    assert stats["model_load_seconds"] < stats["first_row_done_s"] < stats["last_row_done_s"] <= stats["seconds"]
    with open(cache_dir / "failures.csv", newline="", encoding="utf-8") as handle:
        failures = list(csv.reader(handle))
    assert len(failures) == 2 and failures[1][:2] == [str(BROKEN_ROW), "media/video_002.mp4"]
    assert failures[1][2].startswith(f"metadata row {BROKEN_ROW} (media/video_002.mp4): cannot decode")
    index = json.loads((cache_dir / "cache.json").read_text())
    assert [row["row"] for row in index["rows"]] == [r for r in range(1, ROWS + 1) if r != BROKEN_ROW]
    assert index["failed"] == [{"row": BROKEN_ROW, "file": "media/video_002.mp4"}]
    assert index["settings"]["vae"] == "demo-seed-42" and index["settings"]["text_len"] == 32
    shapes = {row["media_type"]: row["latent_shape"] for row in index["rows"]}
    assert shapes == {"video": [48, 3, 4, 4], "image": [48, 1, 4, 4]}
    # The causal VAE's first latent frame is the TI2V first-frame latent, exactly: nothing extra stored.
    assert {row["first_frame"] for row in index["rows"]} == {"derived"}
    assert not list(cache_dir.rglob("*.tmp"))


def test_dataset_pads_the_stored_text_back_with_zeros(demo, reference):
    cache_dir, _ = reference
    dataset = CachedLatentDataset(cache_dir, repeat=2)
    assert dataset.rows == GOOD_ROWS and len(dataset) == 2 * GOOD_ROWS
    sample = dataset[GOOD_ROWS]   # repeat wraps around to the first row
    assert sample["cached"] is True and sample["row"] == 1 and sample["num_frames"] == 9
    index = json.loads((cache_dir / "cache.json").read_text())
    tokens = index["rows"][0]["text_tokens"]
    stored = load_file(str(cache_dir / index["rows"][0]["text"]))["context"]
    assert stored.shape == (tokens, 32) and 1 < tokens < 32
    assert sample["context"].shape == (32, 32)
    assert torch.equal(sample["context"][:tokens], stored)
    assert not sample["context"][tokens:].any() and stored.abs().sum(dim=1).gt(0).all()
    assert torch.equal(sample["first_frame_latents"], sample["input_latents"][:, :1])
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, shuffle=True, collate_fn=list, num_workers=1,
                                         prefetch_factor=2)
    rows = [item["row"] for batch in loader for item in batch]
    assert sorted(rows) == sorted([row["row"] for row in index["rows"]] * 2)


def test_second_run_skips_finished_entries(demo, reference, tmp_path):
    root, _ = demo
    cache_dir = tmp_path / "cache"
    shutil.copytree(reference[0], cache_dir)
    mtimes = {p: p.stat().st_mtime_ns for p in entry_files(cache_dir)}
    summary = run_in_process(root, cache_dir)
    assert (summary["written"], summary["skipped"], summary["failed"]) == (0, GOOD_ROWS, 1)
    assert summary["text_written"] == 0
    assert {p: p.stat().st_mtime_ns for p in entry_files(cache_dir)} == mtimes
    assert_same_cache(reference[0], cache_dir)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_cache_without_encoding_twice(demo, reference, tmp_path):
    root, _ = demo
    cache_dir = tmp_path / "cache"
    job = subprocess.Popen([sys.executable, "-m", "diffsynth_mbc.cache", *flags(root, cache_dir)],
                           env=isolated_env(tmp_path, OMP_NUM_THREADS=1), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(entry_files(cache_dir)) < 2:
        assert job.poll() is None, job.stderr.read()
        assert time.monotonic() < deadline, "the cache job wrote no entries"
        time.sleep(0.02)
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    job.stderr.close()
    assert job.returncode == -signal.SIGKILL
    present = len(entry_files(cache_dir))
    assert 2 <= present < GOOD_ROWS, "the job was not interrupted part-way"
    assert not (cache_dir / "cache.json").exists()   # a killed run never looks finished

    summary = run_in_process(root, cache_dir)
    assert summary["skipped"] == present
    assert summary["written"] == GOOD_ROWS - present
    assert summary["failed"] == 1
    assert summary["text_written"] + summary["text_skipped"] == GOOD_ROWS - present
    assert_same_cache(reference[0], cache_dir)
    assert not list(cache_dir.rglob("*.tmp"))


def test_changed_size_or_file_does_not_reuse_entries(demo, reference, tmp_path):
    root, _ = demo
    cache_dir = tmp_path / "cache"
    shutil.copytree(reference[0], cache_dir)
    summary = run_in_process(root, cache_dir, 96)
    assert (summary["written"], summary["skipped"]) == (GOOD_ROWS, 0)
    assert summary["text_skipped"] == GOOD_ROWS        # captions do not depend on the size
    index = json.loads((cache_dir / "cache.json").read_text())
    assert index["settings"]["height"] == 96
    assert {tuple(row["latent_shape"]) for row in index["rows"]} == {(48, 3, 6, 4), (48, 1, 6, 4)}
    assert len(entry_files(cache_dir)) == 2 * GOOD_ROWS

    touched = root / "catalog" / "media" / "video_003.mp4"
    stat = touched.stat()
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        summary = run_in_process(root, cache_dir, 96)
    finally:
        os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (summary["written"], summary["skipped"], summary["text_written"]) == (1, GOOD_ROWS - 1, 0)


@pytest.mark.slow
def test_two_ranks_shard_the_rows_and_rank0_writes_the_whole_index(demo, reference, tmp_path):
    root, _ = demo
    cache_dir = tmp_path / "cache"
    shutil.copytree(reference[0], cache_dir)
    (cache_dir / "cache.json").unlink()
    reference_index = json.loads((reference[0] / "cache.json").read_text())
    # Rank r takes the rows at 0-based positions r, r+2, ...: rank 1 has metadata rows 2, 4, 6 and encodes
    # rows 2 and 4 again; rank 0 (rows 1, 3, 5) finds its entries on disk, tries the unreadable row 3
    # without loading any model, and waits for rank 1 before writing the index.
    for row in reference_index["rows"]:
        if row["row"] in (2, 4):
            (cache_dir / row["entry"]).unlink()
    # The ranks of `accelerate launch --multi_gpu --num_processes 2 -m diffsynth_mbc.cache` (forked, as the
    # training's tests do; the launcher's --cached test starts them through accelerate itself).
    result = run_training(tmp_path, [*flags(root, cache_dir), "--log_dir", str(tmp_path / "logs")], timeout=240,
                          entry=CACHE_BUILD, ACCELERATE_USE_CPU=1, OMP_NUM_THREADS=1, MBC_RUN_ID="cache-test-1")
    assert result.returncode == 0, result.stderr[-4000:]
    # Each rank wrote its own status file, as the training's ranks do, and ended with its share done.
    for rank in (0, 1):
        state = json.loads((tmp_path / "logs" / f"training_gpu{rank}.json").read_text())
        assert (state["rank"], state["world_size"], state["run_id"]) == (rank, 2, "cache-test-1")
        assert state["status"] == "finished" and state["phase"].startswith("caching done")
        assert state["rows_done"] == state["rows_total"] == 3 and state["eta_s"] == 0.0
        assert state["failures"] == (1 if rank == 0 else 0)
    assert "cannot decode" in json.loads((tmp_path / "logs" / "training_gpu0.json").read_text())["last_failure"]
    assert not list((tmp_path / "logs").glob("*.jsonl"))
    monitor = subprocess.run([sys.executable, "-m", "diffsynth_mbc.monitor", str(tmp_path / "logs"), "--json"],
                             env=isolated_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert monitor.returncode == 0, monitor.stderr
    snap = json.loads(monitor.stdout)
    assert snap["status"] == "finished" and snap["run_id"] == "cache-test-1"
    assert snap["caching"]["phase"] == "cached" and snap["caching"]["rows_done"] == snap["caching"]["rows_total"] == 6
    assert snap["caching"]["failures"] == 1 and (snap["step"], snap["total_steps"]) == (6, 6)
    summary = json.loads((cache_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    per_rank = {item["rank"]: item for item in summary["per_rank"]}
    assert per_rank[0]["rows"] == per_rank[1]["rows"] == 3
    assert (per_rank[0]["written"], per_rank[0]["skipped"], per_rank[0]["failed"]) == (0, 2, 1)
    assert (per_rank[1]["written"], per_rank[1]["skipped"], per_rank[1]["failed"]) == (2, 1, 0)
    for rank in (0, 1):
        shard = json.loads((cache_dir / "shards" / f"rank-{rank:05d}-of-00002.json").read_text())
        handled = {row["row"] for row in shard["rows"]} | {f["row"] for f in shard["failed"]}
        assert handled == set(range(rank + 1, ROWS + 1, 2))
    assert "[rank 1] shard done" in result.stderr
    assert_same_cache(reference[0], cache_dir)


def training_options(root, cache_dir, **overrides):
    values = {"cache": str(cache_dir), "height": 64, "width": 64, "num_frames": 9, "dataset_repeat": 1,
              "dataset_base_path": str(root / "catalog"),
              "dataset_metadata_path": str(root / "metadata" / "metadata.csv"),
              "demo": True, "seed": 42, "model_dir": None, "model_id": None, **overrides}
    return TrainOptions(**values)


def test_training_opens_the_cache_only_when_it_matches(demo, reference, tmp_path):
    root, _ = demo
    cache_dir = reference[0]
    dataset = open_training_dataset(training_options(root, cache_dir, dataset_repeat=3))
    assert isinstance(dataset, CachedLatentDataset) and dataset.rows == GOOD_ROWS and len(dataset) == 3 * GOOD_ROWS
    assert isinstance(open_training_dataset(training_options(root, cache_dir, cache=None)), MBCVideoDataset)

    with pytest.raises(CacheMismatchError, match=r"built for height 64, width 64, num_frames 9; this run asks "
                                                 r"for height 704, width 1280, num_frames 9"):
        open_training_dataset(training_options(root, cache_dir, height=704, width=1280))
    with pytest.raises(CacheMismatchError, match=r"demo-seed-42.*--seed 7 \(demo-seed-7\)"):
        open_training_dataset(training_options(root, cache_dir, seed=7))
    other = tmp_path / "metadata.csv"
    other.write_bytes((root / "metadata" / "metadata.csv").read_bytes() + b"media/extra.mp4,one more,video\r\n")
    with pytest.raises(CacheMismatchError, match=r"--dataset_metadata_path .*metadata\.csv differs"):
        open_training_dataset(training_options(root, cache_dir, dataset_metadata_path=str(other)))
    with pytest.raises(CacheMismatchError, match="encoded by the demo model"):
        open_training_dataset(training_options(root, cache_dir, demo=False, model_id="Wan-AI/Wan2.2-TI2V-5B"))
    with pytest.raises(cache.CacheError, match="no finished latent cache"):
        open_training_dataset(training_options(root, tmp_path / "nothing-here"))


def test_validation_from_a_cache_or_refused_without_encoders(demo, reference, tmp_path):
    root, metadata = demo
    cache_dir = reference[0]
    options = training_options(root, cache_dir, val_metadata_path=str(metadata), val_base_path=None,
                               val_cache=str(cache_dir))
    assert isinstance(open_validation_dataset(options), CachedLatentDataset)
    other = tmp_path / "metadata_val.csv"
    other.write_bytes(metadata.read_bytes() + b"media/extra.mp4,one more,video\r\n")
    options = options.replace(val_metadata_path=str(other))
    with pytest.raises(CacheMismatchError, match="metadata_val.csv differs"):
        open_validation_dataset(options)
    options = options.replace(val_cache=None)
    with pytest.raises(CacheMismatchError, match="pass it as --val_cache"):
        open_validation_dataset(options)


def test_a_truncated_entry_is_named_when_read_and_encoded_again_on_rerun(demo, reference, tmp_path):
    """It once failed with a SafetensorError naming no file, and a rerun took it as done."""
    root, _ = demo
    cache_dir = tmp_path / "cache"
    shutil.copytree(reference[0], cache_dir)
    damaged = entry_files(cache_dir)[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    dataset = CachedLatentDataset(cache_dir)
    row = next(i for i, r in enumerate(dataset.entries) if (cache_dir / r["entry"]) == damaged)
    with pytest.raises(CacheError, match=f"{damaged}.*bytes, the index says"):
        dataset[row]
    summary = run_in_process(root, cache_dir)
    assert summary["rows_cached"] == GOOD_ROWS
    assert_same_cache(reference[0], cache_dir)          # repaired: the same tensors as never damaged
    CachedLatentDataset(cache_dir)[row]


def test_training_refuses_a_cache_whose_media_changed_unless_allowed(demo, reference, tmp_path):
    root, _ = demo
    cache_dir = reference[0]
    media = root / "catalog" / json.loads((cache_dir / "cache.json").read_text())["rows"][0]["file"]
    before = media.stat()
    os.utime(media, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))    # re-exported: a newer file
    try:
        with pytest.raises(CacheMismatchError, match=f"1 media file.*{media.name}: modified.*--allow_stale_cache"):
            open_training_dataset(training_options(root, cache_dir))
        assert open_training_dataset(training_options(root, cache_dir, allow_stale_cache=True)).rows == GOOD_ROWS
    finally:
        os.utime(media, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.slow
def test_an_fp16_cache_stores_float16_and_the_default_follows_the_gpu(demo, reference, tmp_path):
    """--dtype fp16, as for V100s: every stored tensor is float16 and equals the fp32 reference rounded."""
    from diffsynth_mbc.data.cache.cli import default_dtype

    root, _ = demo
    run_in_process(root, tmp_path / "cache16", 64, "--dtype", "fp16")
    index16 = json.loads((tmp_path / "cache16" / "cache.json").read_text())
    index32 = json.loads((reference[0] / "cache.json").read_text())
    assert index16["settings"]["dtype"] == "float16" and index32["settings"]["dtype"] == "float32"
    assert [r["row"] for r in index16["rows"]] == [r["row"] for r in index32["rows"]]
    for row16, row32 in zip(index16["rows"], index32["rows"]):   # the dtype is part of each key: pair by row
        for part in ("entry", "text"):
            half = load_file(str(tmp_path / "cache16" / row16[part]))
            full = load_file(str(reference[0] / row32[part]))
            assert half.keys() == full.keys()
            for key, tensor in half.items():
                assert tensor.dtype == torch.float16, (row16["row"], key)
                assert torch.allclose(tensor.float(), full[key].float(), rtol=2e-2, atol=2e-2), (row16["row"], key)
    assert (default_dtype((7, 0)), default_dtype((8, 0)), default_dtype(None)) == ("fp16", "bf16", "fp32")
