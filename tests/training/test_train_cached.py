"""`launchers/train_test.sh --demo --cached`: the latent cache is built on 2 CPU ranks, then the DiT alone trains from it."""

import json
import subprocess

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from e2e_helpers import REPO, isolated_env, read_history, read_status

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cached_run(tmp_path_factory):
    """One `--demo --cached` launch, read by the tests below: two catalogues (`--datasets FILE`, the second with
    its own repeat and caption prefix) cached in `--cache DIR` on 2 ranks, then the DiT alone trained from it on
    2 ranks with the recipe's options on: a timestep scheme inside a boundary (index 200: level 952.4 of 1000), a
    trigger word, caption dropout, a frame choice, an EMA, DoRA and LoRA+."""
    from diffsynth_mbc.data.demo import prepare

    work = tmp_path_factory.mktemp("cached_run")
    prepare(work / "news", num_videos=3, num_images=2, seed=1)
    prepare(work / "drama", num_videos=2, num_images=1, seed=2)
    listing = [{"base_path": "news/catalog", "metadata_path": "news/metadata/metadata.csv", "name": "news"},
               {"base_path": "drama/catalog", "metadata_path": "drama/metadata/metadata.csv", "name": "drama",
                "repeat": 2, "caption_prefix": "mbc drama, "}]
    (work / "datasets.yaml").write_text(json.dumps(listing))
    result = launch(work)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return work, output


def launch(work, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--cached",
                           "--cache", "runs/my_cache", "--datasets", "datasets.yaml", "--num_epochs", "1",
                           "--timestep_sampling", "shift", "--timestep_shift", "3", "--min_timestep_boundary", "0.2",
                           "--caption_prefix", "mbcstyle", "--caption_dropout", "0.5", "--frame_sampling", "uniform",
                           "--ema_decay", "0.9", "--lora_variant", "dora", "--loraplus_lr_ratio", "4", *more],
                          cwd=work, env=isolated_env(work, OMP_NUM_THREADS=1), capture_output=True, text=True,
                          timeout=400)


def test_the_recipe_options_reach_the_cache_and_train_the_dit_from_it(cached_run):
    """The trigger word, caption dropout and the frame choice given to the launcher reach the cache command too;
    the timestep scheme, an EMA, DoRA and LoRA+ train from the cache."""
    work, _ = cached_run
    cache = work / "runs" / "my_cache"
    summary = json.loads((cache / "summary.json").read_text())
    assert summary["written"] + summary["skipped"] == 8 and summary["failed"] == 0
    index = json.loads((cache / "cache.json").read_text())
    assert index["settings"]["caption_prefix"] == "mbcstyle" and index["empty_prompt"]["text_tokens"] >= 1
    assert all(row["prompt"].startswith("mbcstyle ") for row in index["rows"])
    assert index["settings"]["frames"]["sampling"] == "uniform", index["settings"]
    log_dir = work / "runs" / "demo" / "training_logs"
    for rank in (0, 1):
        state = read_status(log_dir, rank)
        timesteps = [t for line in read_history(log_dir, rank) for t in line["timesteps"]]
        assert len(timesteps) >= 7 and all(0 <= t <= 952.39 for t in timesteps), timesteps
        assert 0 < state["captions_dropped"] < state["samples_seen"]   # some samples, not all, lost the caption
    lora = work / "runs" / "demo" / "lora"
    with safe_open(str(lora / "lora.safetensors"), framework="pt") as trained:
        assert trained.metadata()["lora_variant"] == "dora"
        assert any(key.endswith(".dora_scale") for key in trained.keys())
    assert set(load_file(str(lora / "lora_ema.safetensors"))) == set(load_file(str(lora / "lora.safetensors")))


def test_a_cache_folder_given_with_cached_reaches_the_training_once(cached_run):
    """`--cached --cache DIR` builds the cache in DIR; the printed command used to carry `--cache DIR` twice."""
    work, _ = cached_run
    log, = (work / "runs" / "demo" / "lora").glob("train-*.log")   # the launcher's command is in the run's log
    run_line, = [line for line in log.read_text().splitlines() if line.startswith("run run-")]
    assert run_line.count("--cache") == 1 and "--cache runs/my_cache " in run_line, run_line
    assert json.loads((work / "runs" / "my_cache" / "summary.json").read_text())["failed"] == 0
    assert not (work / "runs" / "demo" / "latent_cache").exists()


def test_two_catalogues_cache_and_train_as_one_on_two_ranks(cached_run):
    """`--datasets FILE` from the launcher: the cache encodes each row of both catalogues once (with its caption
    prefix), the 2 ranks draw each catalogue its own repeat, and plan, status and history agree on the steps."""
    from diffsynth_mbc.data.cache.index import read_index
    from diffsynth_mbc.training.plan.step_plan import StepPlan

    work, output = cached_run
    cache = work / "runs" / "my_cache"
    assert json.loads((cache / "summary.json").read_text())["written"] == 8   # 5 + 3 rows, each once
    prompts = [row["prompt"] for row in read_index(cache)["rows"]]
    assert sum(prompt.startswith("mbcstyle mbc drama, ") for prompt in prompts) == 3   # then the trigger word
    # The demo preset's dataset_repeat 3 multiplies each catalogue's own: news 5 rows x 3, drama 3 rows x 6.
    counts = [{"name": "news", "rows": 5, "videos": 3, "images": 2, "repeat": 1, "samples_per_epoch": 15},
              {"name": "drama", "rows": 3, "videos": 2, "images": 1, "repeat": 2, "samples_per_epoch": 18}]
    log, = (work / "runs" / "demo" / "lora").glob("train-*.log")   # the launcher's full plan is in the run's log
    assert "news: 5 rows (3 videos + 2 images) x repeat 3 = 15 samples" in log.read_text()
    assert "drama: 3 rows (2 videos + 1 images) x repeat 6 = 18 samples" in log.read_text()
    assert "step plan: 7 steps in total per GPU (7 x 1 epoch, 2 GPUs)" in output   # and its total here
    # videos 3x3 + 2x6 = 21 batches of 1, images 2x3 + 1x6 = 12 in batches of 3 -> 25 batches -> 13 per rank
    # -> accumulation 2 -> 7 steps.
    expected = StepPlan(rows=8, repeat=3, world_size=2, batch_size=1, gradient_accumulation=2, num_epochs=1,
                        images=3, image_batch_size=3).total_steps
    assert expected == 5   # the same rows as one catalogue with repeat 3: two steps fewer
    log_dir = work / "runs" / "demo" / "training_logs"
    for rank in (0, 1):
        state = read_status(log_dir, rank)
        assert state["status"] == "finished" and state["step"] == state["total_steps"] == 7
        assert state["plan"]["datasets"] == counts and state["plan"]["samples_per_epoch"] == 33
        assert [line["step"] for line in read_history(log_dir, rank)] == list(range(1, 8))


def test_the_step_records_name_the_cached_rows_each_trained_its_catalogues_repeat(cached_run):
    """From the latent cache too, each step record's `rows` are the metadata rows (0-based) of its samples: over both
    ranks the epoch trains each cached row its catalogue's repeat x 3 (drama's 2, news' 1), and the padding."""
    from collections import Counter

    from diffsynth_mbc.data.cache.index import read_index
    from diffsynth_mbc.data.media.shapes import shape_key
    from diffsynth_mbc.training.plan.batches import epoch_batches

    work, _ = cached_run
    entries = read_index(work / "runs" / "my_cache")["rows"]   # the cached dataset's rows, in its order
    keys = [shape_key(entry["media_type"], entry["file"]) for entry in entries]
    repeats = [2 if entry["prompt"].startswith("mbcstyle mbc drama, ") else 1 for entry in entries]
    planned = Counter(entries[index % len(entries)]["row"] - 1
                      for batch in epoch_batches(keys, 3, {"video": 1, "image": 3}, 2, 42, 0, repeats)
                      for index in batch)
    log_dir = work / "runs" / "demo" / "training_logs"
    trained = Counter(row for rank in (0, 1) for line in read_history(log_dir, rank) for row in line["rows"])
    assert trained == planned
    assert sorted(trained) == list(range(8)) and sum(repeats) == 5 + 2 * 3   # news 5 rows once, drama 3 rows twice


def test_a_resume_of_the_finished_run_says_so_and_starts_nothing(cached_run):
    """`--cached --resume latest` of a run that has ended: the launcher says what the training would (nothing to
    train) before the cache build, the preflight or any rank: it built the whole cache again first, then launched
    ranks to say it."""
    work, _ = cached_run
    runs = work / "runs"
    before = {path: path.read_bytes() for path in runs.rglob("*") if path.is_file()}
    result = launch(work, "--resume", "latest")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.strip().startswith("this run finished at step 7 (1 of 1 epochs): nothing more to train; nothing "
                                     "was written"), output[-4000:]
    assert "latent cache" not in output and "process(es) here" not in output and "step plan" not in output
    assert {path: path.read_bytes() for path in runs.rglob("*") if path.is_file()} == before   # no file new or changed
