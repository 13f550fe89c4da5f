"""A plan of absurd size is refused before anything runs, naming the catalogue, the value and the limit: each rank's
batch sampler draws every sample of an epoch up front (``repeat: 1000000000`` grew the ranks by 250 MB/s)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from catalog_helpers import clip, write_metadata
from diffsynth_mbc.data.dataset_list import MAX_REPEAT, MAX_SAMPLES_PER_EPOCH
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.options import resolve_options


def catalogue(folder, rows: int):
    """A converted catalogue of ``rows`` clips (the media need not be there to plan)."""
    (folder / "media").mkdir(parents=True)
    write_metadata(folder / "metadata.csv", [clip(f"clip{i}.mp4", caption=f"clip {i}") for i in range(rows)])
    return folder


def datasets_file(tmp_path, *items):
    path = tmp_path / "datasets.yaml"
    path.write_text("datasets:\n" + "".join(f"  - {item}\n" for item in items), encoding="utf-8")
    return path


def test_the_limits_fit_a_real_run():
    """The full MBC archive (170,180 rows) at repeat 50, or a 20-image style set at repeat 10,000, still plans."""
    assert 170_180 * 50 <= MAX_SAMPLES_PER_EPOCH and 20 * MAX_REPEAT <= MAX_SAMPLES_PER_EPOCH


def test_a_billion_repeat_in_datasets_is_refused_naming_the_catalogue_and_the_limit(tmp_path):
    news = catalogue(tmp_path / "news", 3)
    listing = datasets_file(tmp_path, f"{{base_path: {news / 'media'}, metadata_path: {news / 'metadata.csv'}, "
                                      "repeat: 1000000000, name: news}")
    started = time.monotonic()
    with pytest.raises(OptionsError) as error:
        resolve_options(["--datasets", str(listing), "--output_path", str(tmp_path / "out")])
    assert time.monotonic() - started < 5
    assert str(error.value).startswith(f"--datasets {listing}[0] (news, {news / 'metadata.csv'}): repeat "
                                       "1,000,000,000 is above 10,000, the most a catalogue is repeated per epoch")
    assert not (tmp_path / "out").exists()   # refused before the combined metadata is written


def test_datasets_whose_epoch_is_too_large_are_refused_naming_the_largest_catalogue(tmp_path):
    news, drama = catalogue(tmp_path / "news", 2_000), catalogue(tmp_path / "drama", 5)
    listing = datasets_file(
        tmp_path, f"{{base_path: {news / 'media'}, metadata_path: {news / 'metadata.csv'}, repeat: 6000, name: news}}",
        f"{{base_path: {drama / 'media'}, metadata_path: {drama / 'metadata.csv'}, name: drama}}")
    with pytest.raises(OptionsError) as error:
        resolve_options(["--datasets", str(listing), "--output_path", str(tmp_path / "out")])
    assert str(error.value).startswith(
        f"datasets[0] (news, {news / 'metadata.csv'}): 2,000 rows x repeat 6,000 = 12,000,000 samples per epoch "
        "(12,000,005 with every catalogue), above 10,000,000, the most one epoch takes")
    # --dataset_repeat multiplies every catalogue's repeat: it counts too.
    listing = datasets_file(tmp_path, f"{{base_path: {news / 'media'}, metadata_path: {news / 'metadata.csv'}, "
                                      "repeat: 3000, name: news}")
    assert resolve_options(["--datasets", str(listing), "--output_path", str(tmp_path / "ok")]).datasets
    with pytest.raises(OptionsError, match=r"2,000 rows x repeat 3,000 x --dataset_repeat 2 = 12,000,000 samples"):
        resolve_options(["--datasets", str(listing), "--output_path", str(tmp_path / "o2"), "--dataset_repeat", "2"])


def run(command, *args):
    return subprocess.run([sys.executable, "-m", f"diffsynth_mbc.{command}", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_a_billion_dataset_repeat_is_refused_by_the_training_naming_the_catalogue(tmp_path):
    data = catalogue(tmp_path / "data", 3)
    result = run("train", "--demo", "--dataset_base_path", data / "media", "--dataset_metadata_path",
                 data / "metadata.csv", "--output_path", tmp_path / "out", "--dataset_repeat", "1000000000")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (f"error: --dataset_repeat 1,000,000,000 is above 10,000, the most a catalogue ({data / 'metadata.csv'}) "
            "is repeated per epoch; train more epochs (--num_epochs) instead") in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_plan_of_one_catalogue_too_large_for_an_epoch_is_refused_naming_it(tmp_path):
    data = catalogue(tmp_path / "data", 1_001)
    flags = ["--gpus", "2", "--dataset_base_path", data / "media", "--dataset_metadata_path", data / "metadata.csv",
             "--output_path", tmp_path / "out"]
    result = run("plan", *flags, "--dataset_repeat", "10000")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (f"error: --dataset_metadata_path {data / 'metadata.csv'}: 1,001 rows x --dataset_repeat 10,000 = "
            "10,010,000 samples per epoch, above 10,000,000") in result.stderr
    assert "steps in total" not in result.stderr
    assert run("plan", *flags, "--dataset_repeat", "9000").returncode == 0
