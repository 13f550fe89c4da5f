"""A launch reads each media file's size once: the plan reads every header (with its progress) into the run's size
table; the doctor, the ranks and a resume look the files up there (each of them read every header again: 170K rows
took minutes before the ranks started and minutes more in them)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace

import pytest

from catalog_helpers import LANDSCAPE, STREET, STUDIO, clip, image, write_media, write_metadata
from diffsynth_mbc.data.media.size_table import LONG_READ
from diffsynth_mbc.run_layout import SIZE_TABLE
from e2e_helpers import REPO, isolated_env, read_status

pytestmark = pytest.mark.slow

IMAGES = LONG_READ + 16


def test_a_launch_reads_each_file_size_once_with_progress(tmp_path):
    base = tmp_path / "mine" / "catalog"
    wide, tall = image("media/wide.png", 80, 40, seed=1), image("media/tall.png", 40, 80, seed=2)
    street = clip("media/clip.mp4", *LANDSCAPE, seed=3, caption=STREET)
    write_media(base, [wide, tall, street])
    rows = [street]
    for index in range(IMAGES):   # hard links: each row its own path, so its own entry in the table
        source = wide if index % 2 else tall
        rows.append(replace(source, file=f"media/{index:04d}.png", caption=f"{STUDIO} #{index}"))
        os.link(base / source.file, base / rows[-1].file)
    write_metadata(tmp_path / "mine" / "metadata.csv", rows)
    launch = subprocess.run(
        ["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--dataset_base_path", "mine/catalog",
         "--dataset_metadata_path", "mine/metadata.csv", "--buckets", "aspect", "--height", "64", "--width", "128",
         "--num_epochs", "1", "--dataset_repeat", "1", "--image_batch_size", "8"],
        cwd=tmp_path, env=isolated_env(tmp_path), capture_output=True, text=True, timeout=400)
    run = tmp_path / "runs" / "demo"
    log_files = sorted((run / "lora").glob("train-*.log"))
    said = launch.stdout + launch.stderr + "".join(path.read_text() for path in log_files)
    assert launch.returncode == 0, said[-4000:]
    read_once = f"reading media sizes: {IMAGES + 1}/{IMAGES + 1} files"   # the plan's; no other reader's
    assert said.count(read_once) == 1 and "reading media sizes" not in said.replace(read_once, ""), said[-4000:]
    table = json.loads((run / "lora" / SIZE_TABLE).read_text())["sizes"]
    assert len(table) == IMAGES + 1 and sorted(set(map(tuple, table.values()))) == [(40, 80), (80, 40), (128, 72)]
    assert read_status(run / "training_logs", 0)["status"] == "finished"
