"""Several catalogues in one run (``datasets:``): one combined metadata, per-catalogue repeats and counts."""

import csv
import os

import pytest
import yaml

from catalog_helpers import clip, write_metadata
from diffsynth_mbc.data.dataset_list import (Catalogue, DatasetCount, dataset_counts, metadata_counts, parse_datasets,
                                             row_repeats, write_combined)
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints.fingerprint import fingerprint_differences, run_fingerprint
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.plan.batches import batches_per_rank, epoch_batches
from diffsynth_mbc.training.plan.step_plan import StepPlan


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two tiny converted catalogues: news (3 videos + 2 images) and drama (2 videos + 1 image)."""
    root = tmp_path_factory.mktemp("catalogues")
    prepare(root / "news", num_videos=3, num_images=2, seed=1)
    prepare(root / "drama", num_videos=2, num_images=1, seed=2)
    return root


def items(root, **drama):
    return [{"base_path": str(root / "news" / "catalog"), "name": "news",
             "metadata_path": str(root / "news" / "metadata" / "metadata.csv")},
            {"base_path": str(root / "drama" / "catalog"), "name": "drama",
             "metadata_path": str(root / "drama" / "metadata" / "metadata.csv"), **drama}]


def read(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_combined_metadata_has_every_row_with_its_catalogue_prefix_and_absolute_file(two, tmp_path):
    catalogues = parse_datasets(items(two, caption_prefix="mbc drama, ", repeat=3))
    rows = read(write_combined(catalogues, tmp_path))
    assert [r["dataset"] for r in rows] == ["0"] * 5 + ["1"] * 3
    originals = read(two / "drama" / "metadata" / "metadata.csv")
    assert [r["prompt"] for r in rows[5:]] == ["mbc drama, " + r["prompt"] for r in originals]
    assert rows[0]["prompt"] == read(two / "news" / "metadata" / "metadata.csv")[0]["prompt"]   # no prefix: as is
    assert all(r["video"].startswith("/") and (two / r["video"]).is_file() for r in rows)
    assert [r["media_type"] for r in rows] == ["video"] * 3 + ["image"] * 2 + ["video"] * 2 + ["image"]


def test_the_combined_metadata_is_rewritten_only_when_it_changes(two, tmp_path):
    """Every process of a launch and each resume makes it; the same bytes leave the file (its inode and time) as it
    was, another prefix replaces it."""
    path = write_combined(parse_datasets(items(two)), tmp_path)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = path.stat()
    assert write_combined(parse_datasets(items(two)), tmp_path) == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, 1_000_000_000)
    write_combined(parse_datasets(items(two, caption_prefix="mbc drama, ")), tmp_path)
    assert path.stat().st_mtime_ns != 1_000_000_000
    assert read(path)[5]["prompt"].startswith("mbc drama, ")


def test_media_filter_keeps_one_kind(two, tmp_path):
    rows = read(write_combined(parse_datasets(items(two, media="image")), tmp_path))
    assert [(r["dataset"], r["media_type"]) for r in rows[5:]] == [("1", "image")]


@pytest.mark.parametrize("bad, message", [
    ([], "non-empty list"),
    ([{"metadata_path": "m.csv"}], "datasets[0]: base_path is required"),
    ([{"base_path": ".", "metadata_path": "m.csv", "repeat": 0}], "datasets[0]: repeat must be a positive integer"),
    ([{"base_path": ".", "metadata_path": "m.csv", "media": "audio"}], "datasets[0]: media must be one of"),
    ([{"base_path": ".", "metadata_path": "m.csv", "weight": 2}], "datasets[0]: unknown key(s) weight"),
])
def test_bad_items_are_refused_naming_the_item_and_key(bad, message):
    with pytest.raises(OptionsError) as caught:
        parse_datasets(bad)
    assert message in str(caught.value)


def test_a_missing_metadata_file_or_an_empty_filter_names_the_catalogue(two, tmp_path):
    with pytest.raises(OptionsError, match=r"datasets\[1\] \(drama\): metadata_path .*nothing.csv not found"):
        write_combined(parse_datasets(items(two, metadata_path=str(two / "nothing.csv"))), tmp_path)
    write_metadata(tmp_path / "videos.csv", [clip("media/video_000.mp4")])
    only_videos = items(two, media="image", metadata_path=str(tmp_path / "videos.csv"))
    with pytest.raises(OptionsError, match=r"datasets\[1\] \(drama\): .* keeps no rows with media: image"):
        write_combined(parse_datasets(only_videos), tmp_path)


@pytest.mark.parametrize("repeats, global_repeat, world_size, batch, image_batch", [
    ((1, 3), 1, 2, 1, 3), ((2, 5), 2, 2, 2, 1), ((4, 1), 1, 3, 1, 2), ((1, 1), 3, 2, 2, 3)])
def test_sampler_draws_each_row_its_catalogues_repeat_and_the_plan_counts_the_same(repeats, global_repeat,
                                                                                    world_size, batch, image_batch):
    keys = ["video"] * 3 + ["image"] * 2 + ["video"] * 2 + ["image"]
    positions = [0] * 5 + [1] * 3
    catalogues = [Catalogue("news", ".", "a.csv", repeats[0]), Catalogue("drama", ".", "b.csv", repeats[1])]
    per_row = row_repeats(catalogues, positions)
    sizes = {"video": batch, "image": image_batch}
    batches = epoch_batches(keys, global_repeat, sizes, world_size, seed=7, epoch=1, row_repeats=per_row)
    unpadded = batches_per_rank(keys, global_repeat, sizes, 1, per_row)
    drawn = [index % len(keys) for one in batches[:unpadded] for index in one]
    assert sorted(drawn) == sorted(row for row in range(8) for _ in range(repeats[positions[row]] * global_repeat))
    assert all(len({keys[i % 8] for i in one}) == 1 for one in batches)   # one shape per batch
    plan = StepPlan(rows=8, repeat=global_repeat, world_size=world_size, batch_size=batch, gradient_accumulation=1,
                    num_epochs=1, images=3, image_batch_size=image_batch,
                    datasets=dataset_counts(catalogues, positions, keys))
    assert plan.batches_per_epoch * world_size == len(batches)
    assert plan.samples_per_epoch == len(drawn)
    assert [d["samples_per_epoch"] for d in plan.as_dict()["datasets"]] == [
        5 * repeats[0] * global_repeat, 3 * repeats[1] * global_repeat]


def test_one_catalogue_draws_and_plans_exactly_as_before():
    keys = ["video"] * 6 + ["image"] * 5
    sizes = {"video": 1, "image": 3}
    assert epoch_batches(keys, 3, sizes, 2, 42, 0) == epoch_batches(keys, 3, sizes, 2, 42, 0, row_repeats=None)
    catalogues = [Catalogue("a", ".", "a.csv"), Catalogue("b", ".", "b.csv")]
    assert row_repeats(catalogues, [0] * 6 + [1] * 5) is None   # all repeats 1: the one-catalogue draw
    plan = StepPlan(rows=11, repeat=3, world_size=2, batch_size=1, gradient_accumulation=2, num_epochs=2, images=5,
                    image_batch_size=3)
    assert "datasets" not in plan.as_dict()
    counted = StepPlan(rows=11, repeat=3, world_size=2, batch_size=1, gradient_accumulation=2, num_epochs=2,
                       images=5, image_batch_size=3, datasets=(DatasetCount("a", 6, 0, 1), DatasetCount("b", 0, 5, 1)))
    assert counted.total_steps == plan.total_steps and counted.samples_per_epoch == plan.samples_per_epoch


def test_preset_lists_catalogues_and_the_flag_reads_a_file(two, tmp_path):
    preset = tmp_path / "train.yaml"
    preset.write_text(yaml.safe_dump({"datasets": items(two, repeat=2), "output_path": str(tmp_path / "out")}))
    options = resolve_options(["--config", str(preset)])
    assert options.dataset_metadata_path == str(tmp_path / "out" / "datasets" / "metadata.csv")
    assert [c.repeat for c in options.datasets] == [1, 2] and len(read(options.dataset_metadata_path)) == 8
    listing = tmp_path / "datasets.yaml"
    listing.write_text(yaml.safe_dump(items(two, media="video")))
    flagged = resolve_options(["--datasets", str(listing), "--output_path", str(tmp_path / "flag")])
    assert len(read(flagged.dataset_metadata_path)) == 7
    # The command line beats the preset, either way round; both at one level are refused.
    single = resolve_options(["--config", str(preset), "--dataset_base_path", str(two / "news" / "catalog"),
                              "--dataset_metadata_path", str(two / "news" / "metadata" / "metadata.csv")])
    assert single.datasets is None and single.dataset_metadata_path.endswith("news/metadata/metadata.csv")
    with pytest.raises(OptionsError, match="do not give --dataset_metadata_path beside it"):
        resolve_options(["--datasets", str(listing), "--dataset_metadata_path", "m.csv",
                         "--output_path", str(tmp_path / "x")])


def test_the_doctor_projects_each_catalogue_at_its_own_repeat(two, tmp_path):
    """The doctor's run length counted every row once whatever its catalogue's repeat."""
    from diffsynth_mbc.training.plan.estimates import run_shape

    preset = tmp_path / "train.yaml"
    preset.write_text(yaml.safe_dump({"datasets": items(two, repeat=3), "output_path": str(tmp_path / "out")}))
    options = resolve_options(["--config", str(preset)])
    counts = metadata_counts(options)
    shape = run_shape(options, (sum(c.videos for c in counts), sum(c.images for c in counts)), gpus=2, nodes=1)
    # the projection times the training's own step plan, which draws each catalogue's rows at its repeat
    assert shape.plan.datasets == counts
    assert shape.plan.samples_per_epoch == sum((c.videos + c.images) * c.repeat for c in counts)
    assert shape.plan.samples_per_epoch > shape.videos + shape.images   # the second catalogue's repeat 3 counts


def test_a_resume_with_another_catalogue_repeat_is_a_difference(two, tmp_path):
    def fingerprint(repeat):
        preset = tmp_path / f"r{repeat}.yaml"
        preset.write_text(yaml.safe_dump({"datasets": items(two, repeat=repeat), "output_path": str(tmp_path / "o")}))
        options = resolve_options(["--config", str(preset)])
        return run_fingerprint(options, world_size=2, accumulation=1, rows=8, metadata_sha256="x", image_batch=3,
                               precision="no")
    assert fingerprint_differences(fingerprint(1), fingerprint(3)) == [
        "dataset_repeats: checkpoint [1, 1], this run [1, 3]"]
