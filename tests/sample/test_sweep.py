"""``python -m diffsynth_mbc.sample`` on the files of real 2-rank demo runs (a LoRA run with sample prompts and
validation, a DoRA run): every prompt x file x strength rendered with the base once per prompt, each file's clip at
strength 1 the run's own sample clip of its step, ``--validate`` the run's own validation records, a second
invocation renders nothing, Ctrl-C and a rerun complete it, ``--gpus 2`` shares the clips out, the sheet shows every
clip in Chromium."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from browser_helpers import needs_browser, start_chromium
from clip_frames import clip_frames
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.sample.cli import main as sample_main
from e2e_helpers import REPO, demo_flags, isolated_env, read_history, run_main
from forked_ranks import run_training

pytestmark = pytest.mark.slow
PROMPTS = """\
- prompt: a news anchor in the studio
  steps: 3
- prompt: a city street at night
  image: first.png
  steps: 3
  seed: 9
"""
T2V, I2V = "01-a-news-anchor-in-the-studio", "02-a-city-street-at-night"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A LoRA run (samples, validation and a LoRA file every 2 steps, 6 steps, an epoch every 3) and a DoRA run
    (3 steps, validated on 3 samples: another run's validation settings)."""
    root = tmp_path_factory.mktemp("sweep")
    prepare(root / "demo", num_videos=3, num_images=2)
    prepare(root / "val", num_videos=2, num_images=2)
    Image.new("RGB", (64, 64), (200, 40, 40)).save(root / "first.png")
    (root / "prompts.yaml").write_text(PROMPTS)
    every = {"sample_prompts": root / "prompts.yaml", "sample_steps": 2, "save_steps": 2,
             "val_metadata_path": root / "val" / "metadata" / "metadata.csv", "val_base_path": root / "val" / "catalog",
             "val_steps": 2, "val_samples": 4}
    for name, extra in (("lora", {}), ("dora", {"lora_variant": "dora", "num_epochs": 1, "val_samples": 3})):
        result = run_training(root, demo_flags(root / "demo", root / name, **{**every, **extra}), timeout=400,
                              OMP_NUM_THREADS=1)
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def sweep(root, output, *more, lora="lora/lora"):
    return run_main(sample_main, [root / "prompts.yaml", "--lora", root / lora, "--output", root / output, *more], root)


@pytest.fixture(scope="module")
def swept(runs):
    result = sweep(runs, "swept", "--strengths", "0,0.5,1", "--validate")
    assert result.returncode == 0, result.stderr[-3000:]
    return runs / "swept", result


def test_every_file_and_strength_is_rendered_with_the_base_once_per_prompt(swept):
    output, result = swept
    record = json.loads((output / "sweep.json").read_text())
    # lora, epoch-002, step-6 and the last checkpoint are one step's weights: rendered once, as lora
    assert [(item["key"], item["step"]) for item in record["files"]] == [
        ("step-00000002", 2), ("epoch-001", 3), ("step-00000004", 4), ("lora", 6)]
    assert "sweep: 4 file(s) x 2 prompt(s) at strength 0,0.5,1: 18 clips, 18 to render" in result.stderr
    base = [clip for clip in record["clips"] if clip["file"] is None]
    assert [clip["path"] for clip in base] == [f"base/{T2V}-base", f"base/{I2V}-base"]
    assert len(record["clips"]) == 18 and all(clip["seconds"] > 0 for clip in record["clips"])
    for clip in record["clips"]:
        frames = clip_frames(output / clip["video"])
        assert frames.shape == (9, 64, 64, 3), clip["path"]
        assert Image.open(output / clip["still"]).size == (64, 64)
    by_strength = {clip["strength"] for clip in record["clips"] if clip["file"] == "lora"}
    assert by_strength == {0.5, 1.0}


def test_the_file_of_step_n_renders_the_runs_own_sample_of_step_n(swept, runs):
    output, _ = swept
    for step in (2, 4, 6):
        key = "lora" if step == 6 else f"step-{step:08d}"
        for stem in (T2V, I2V):   # text-to-video and image-to-video
            ours = clip_frames(output / key / f"{stem}.mp4")
            theirs = clip_frames(runs / "lora" / "lora" / "samples" / f"step-{step:08d}" / f"{stem}.mp4")
            assert np.array_equal(ours, theirs), (step, stem)


def test_validate_measures_what_the_run_measured_at_each_step(swept, runs):
    output, result = swept
    record = json.loads((output / "sweep.json").read_text())
    validations = {line["step"]: line for line in read_history(runs / "lora" / "logs", 0) if line.get("kind") == "val"}
    for item in record["files"]:
        if item["step"] in validations:
            theirs = validations[item["step"]]
            assert item["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-9), item["key"]
            assert item["val_loss_by_quantile"] == pytest.approx(theirs["val_loss_by_quantile"], rel=1e-9)
            assert item["val_loss_by_mode"] == pytest.approx(theirs["val_loss_by_mode"], rel=1e-9)
    assert record["base"]["val_loss"] == pytest.approx(validations[2]["val_loss_base"], rel=1e-9)
    lowest = min(record["files"], key=lambda item: item["val_loss"])
    best = record["best"]
    assert best["key"] == lowest["key"] and best["val_loss"] == lowest["val_loss"]
    assert best["gain"] == pytest.approx((record["base"]["val_loss"] - best["val_loss"]) / record["base"]["val_loss"])
    assert f"best: {best['label']} (step {best['step']}) val_loss" in result.stderr


def test_a_second_invocation_renders_nothing(swept, runs):
    output, _ = swept
    before = {path: path.stat().st_mtime_ns for path in output.rglob("*.mp4")}
    again = sweep(runs, "swept", "--strengths", "0,0.5,1", "--validate")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "18 clips, 0 to render" in again.stderr
    assert {path: path.stat().st_mtime_ns for path in output.rglob("*.mp4")} == before


def test_ctrl_c_leaves_no_half_written_clip_and_a_rerun_renders_the_rest(runs, tmp_path):
    output = tmp_path / "interrupted"
    command = [sys.executable, "-m", "diffsynth_mbc.sample", str(runs / "prompts.yaml"), "--lora",
               str(runs / "lora" / "lora"), "--output", str(output), "--strengths", "0,1"]
    # Ctrl-C's default in the command (a background job, as CI may run the tests in, starts with SIGINT ignored,
    # which its children inherit and Python then keeps)
    process = subprocess.Popen(command, cwd=runs, env=isolated_env(tmp_path, OMP_NUM_THREADS="1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    records = output / ".sweep-records" / "rank-0.json"
    deadline = time.monotonic() + 120
    while not (records.is_file() and len(json.loads(records.read_text() or "[]")) >= 2):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr[-3000:]
    assert "stopped: the clips rendered so far are kept" in stderr
    assert not [path for path in output.rglob("*") if path.name.startswith(".") and path.is_file()
                and path.parent.name != ".sweep-records"], "a temp file was left"
    done = len(json.loads(records.read_text()))
    rerun = sweep(runs, output, "--strengths", "0,1")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"10 clips, {10 - done} to render" in rerun.stderr
    record = json.loads((output / "sweep.json").read_text())
    assert len(record["clips"]) == 10 and not (output / ".sweep-records").exists()


def test_two_processes_share_the_clips_and_render_the_same_ones(swept, runs, tmp_path):
    output = tmp_path / "shared"
    environment = isolated_env(tmp_path)
    environment.pop("PYTHONWARNINGS", None)   # run as a user runs it, not by a launcher that filters warnings
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.sample", str(runs / "prompts.yaml"), "--lora",
                             str(runs / "lora" / "lora"), "--output", str(output), "--strengths", "0,1", "--validate",
                             "--gpus", "2"], cwd=runs, env=environment, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "10 clips, 10 to render on 2 processes" in result.stderr
    # torch's deprecation notices, from accelerate's launcher and from each process, say nothing a user can act on
    assert "pynvml" not in result.stderr and "torch.jit.script" not in result.stderr, result.stderr[-3000:]
    single = json.loads((swept[0] / "sweep.json").read_text())
    shared = json.loads((output / "sweep.json").read_text())
    assert [item["val_loss"] for item in shared["files"]] == pytest.approx(
        [item["val_loss"] for item in single["files"]], rel=1e-9)
    for clip in shared["clips"]:
        assert np.array_equal(clip_frames(output / clip["video"]), clip_frames(swept[0] / clip["video"])), clip["path"]


def test_a_dora_runs_files_render_as_the_run_sampled_them(runs):
    result = sweep(runs, "dora-swept", "--strengths", "1", lora="dora/lora")
    assert result.returncode == 0, result.stderr[-3000:]
    output = runs / "dora-swept"
    record = json.loads((output / "sweep.json").read_text())
    assert [item["key"] for item in record["files"]] == ["step-00000002", "lora"]
    # The file holds ComfyUI's dora_scale (m ||W|| / ||W + s B A||, fp32), from which the magnitude is taken back:
    # a last-bit difference that the H.264 encoding of a few pixels shows (measured: 2% of the pixels of one clip, by
    # at most 6 of 255, 0.03 on average).
    for stem in (T2V, I2V):
        ours = clip_frames(output / "step-00000002" / f"{stem}.mp4").astype(int)
        theirs = clip_frames(runs / "dora" / "lora" / "samples" / "step-00000002" / f"{stem}.mp4").astype(int)
        difference = np.abs(ours - theirs)
        assert difference.mean() < 0.1 and (difference > 0).mean() < 0.05 and difference.max() <= 12, stem


def test_a_file_for_another_base_model_and_a_folder_without_loras_are_refused(runs, tmp_path):
    from safetensors.torch import load_file, save_file

    source = runs / "lora" / "lora" / "step-4.safetensors"
    from safetensors import safe_open
    metadata = dict(safe_open(str(source), framework="pt").metadata())
    save_file(load_file(str(source)), str(tmp_path / "other.safetensors"),
              metadata={**metadata, "base_model": "Wan2.1-T2V-14B"})
    other = run_main(sample_main, [runs / "prompts.yaml", "--lora", tmp_path / "other.safetensors", "--output",
                                   tmp_path / "out", "--demo"], runs)
    assert other.returncode == 2
    assert other.stderr.strip() == (f"error: {tmp_path / 'other.safetensors'}: made for Wan2.1-T2V-14B, not "
                                    "Wan2.2-TI2V-5B (demo); a LoRA renders only with the base model it was trained on")
    (tmp_path / "empty").mkdir()
    empty = run_main(sample_main, [runs / "prompts.yaml", "--lora", tmp_path / "empty", "--output", tmp_path / "out",
                                   "--demo"], runs)
    assert empty.returncode == 2 and f"--lora {tmp_path / 'empty'}: a folder with no LoRA file" in empty.stderr
    unvalidated = run_main(sample_main, [runs / "prompts.yaml", "--lora", tmp_path / "other.safetensors", "--output",
                                         tmp_path / "out", "--demo", "--validate"], runs)
    assert unvalidated.returncode == 2 and "--validate: the files are not a run's" in unvalidated.stderr


@needs_browser
def test_the_sheet_shows_every_clip_looping_with_the_best_file_marked(swept, tmp_path):
    output, _ = swept
    record = json.loads((output / "sweep.json").read_text())
    driver = start_chromium(1400, 900)
    try:
        driver.get((output / "sweep.html").as_uri())
        deadline = time.monotonic() + 30
        script = "return Array.from(document.querySelectorAll('video')).map(v => [v.readyState, v.loop, v.paused])"
        while True:
            videos = driver.execute_script(script)
            if all(state >= 2 for state, _, _ in videos) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(videos) == len(record["clips"]) == 18
        assert all(state >= 2 and loop for state, loop, _ in videos), videos   # every clip decoded, looping
        heads = driver.execute_script("return Array.from(document.querySelectorAll('th')).map(t => t.innerText)")
        best = [head for head in heads if "best" in head]
        assert len(best) == 2 and all(head.startswith(record["best"]["label"]) for head in best)   # 2 strengths
        # the best file's columns are on screen without scrolling, the summary above the table says it
        script = "return [window.innerWidth, Array.from(document.querySelectorAll('th.best')).map(t => " \
                 "t.getBoundingClientRect().right)]"
        width, rights = driver.execute_script(script)
        assert len(rights) == 2 and all(0 < right <= width for right in rights), (width, rights)
        summary = driver.execute_script("return document.querySelector('.summary').innerText").splitlines()
        best, base = record["best"], record["base"]["val_loss"]
        assert summary[0] == (f"best: {best['label']} (step {best['step']}): val_loss {best['val_loss']:.5g}, "
                              f"{100 * best['gain']:.2f}% below the base ({base:.5g}); {best['path']}")
        assert summary[1] == f"run: {runs_folder(record)}" and summary[2].startswith("validation at 64x64x9: 4 samples")
        assert summary[-1] == "only strength 1 is validated: the 0.5 columns show clips, not figures"
        # only strength 1 is validated: a 0.5 column shows no figure as if measured; one wording for the gain
        halves = [head for head in heads if "strength 0.5" in head]
        assert len(halves) == 4 and all("val_loss" not in head and "not validated" in head for head in halves)
        page = driver.execute_script("return document.body.innerText")
        assert "vs the base" not in page and page.count("below the base") >= 4
        driver.save_screenshot(str(tmp_path / "sweep.png"))
    finally:
        driver.quit()


def runs_folder(record) -> str:
    (folder,) = {item["run_dir"] for item in record["files"]}
    return folder


def test_a_rewritten_file_and_another_model_render_again_and_every_clip_stays_in_the_output(swept, runs, tmp_path):
    """A file rewritten at the same path (a resume, --start_over) and the demo's model of another --seed are
    rendered again; a file named ``...safetensors`` (its stem ``..``) writes its clips inside --output."""
    folder = tmp_path / "files"
    folder.mkdir()
    odd = folder / "...safetensors"
    shutil.copyfile(runs / "lora" / "lora" / "step-2.safetensors", odd)
    output = folder / "out"
    flags = [runs / "prompts.yaml", "--lora", odd, "--output", output, "--strengths", "0,1", "--demo", "--height",
             "64", "--width", "64", "--num_frames", "9"]
    first = run_main(sample_main, flags, runs)
    assert first.returncode == 0 and "4 clips, 4 to render" in first.stderr, first.stderr[-3000:]
    assert sorted(path.name for path in folder.iterdir()) == ["...safetensors", "out"]   # nothing beside --output
    assert [item["key"] for item in json.loads((output / "sweep.json").read_text())["files"]] == ["file"]
    assert np.array_equal(clip_frames(output / "file" / f"{T2V}.mp4"),
                          clip_frames(swept[0] / "step-00000002" / f"{T2V}.mp4"))
    shutil.copyfile(runs / "lora" / "lora" / "step-4.safetensors", odd)   # rewritten at the same path
    second = run_main(sample_main, flags, runs)
    assert second.returncode == 0 and "4 clips, 2 to render" in second.stderr, second.stderr[-3000:]   # base kept
    for stem in (T2V, I2V):
        assert np.array_equal(clip_frames(output / "file" / f"{stem}.mp4"),
                              clip_frames(swept[0] / "step-00000004" / f"{stem}.mp4")), stem
    third = run_main(sample_main, [*flags, "--seed", "7"], runs)   # the demo's model of another seed
    assert third.returncode == 0 and "4 clips, 4 to render" in third.stderr, third.stderr[-3000:]


def test_two_runs_in_one_sweep_keep_their_clips_apart_and_say_which_settings_judged_them(swept, runs):
    """The LoRA run's lora.safetensors and the DoRA run (validated on 3 samples) in one sweep: each run's clips under
    its own folder and column, the LoRA run's clip the one its own sweep made, the best marked once, and the DoRA run
    named as measured at the first run's settings, not its own."""
    result = run_main(sample_main, [runs / "prompts.yaml", "--lora", runs / "lora" / "lora" / "lora.safetensors",
                                    runs / "dora" / "lora", "--output", runs / "two-runs", "--strengths", "1",
                                    "--validate"], runs)
    assert result.returncode == 0, result.stderr[-3000:]
    output = runs / "two-runs"
    record = json.loads((output / "sweep.json").read_text())
    assert [(item["key"], item["run"]) for item in record["files"]] == [
        ("dora-lora/step-00000002", "dora/lora"), ("dora-lora/lora", "dora/lora"), ("lora-lora/lora", "lora/lora")]
    assert len({clip["path"] for clip in record["clips"]}) == len(record["clips"]) == 6
    for stem in (T2V, I2V):
        ours = clip_frames(output / "lora-lora" / "lora" / f"{stem}.mp4")
        assert np.array_equal(ours, clip_frames(swept[0] / "lora" / f"{stem}.mp4")), stem
        assert not np.array_equal(ours, clip_frames(output / "dora-lora" / "lora" / f"{stem}.mp4")), stem
    single = {item["key"]: item["val_loss"] for item in json.loads((swept[0] / "sweep.json").read_text())["files"]}
    assert record["files"][2]["val_loss"] == pytest.approx(single["lora"], rel=1e-9)   # the first run's settings
    note = "dora/lora: its own validation is at val_samples 3; its figures here are measured at the settings above"
    assert note in result.stderr and record["validation_notes"][1].startswith(note)
    page = (output / "sweep.html").read_text()
    assert page.count('<th class="best"') == 1 and "dora/lora" in page and note in page


def test_a_file_in_diffsynths_layout_renders_as_the_comfyui_file_it_came_from(swept, runs):
    from diffsynth_mbc.training.lora.export import main as export_main

    exported = run_main(export_main, [runs / "lora" / "lora" / "step-2.safetensors", "--format", "diffsynth",
                                      "--output", runs / "diffsynth-layout.safetensors"], runs)
    assert exported.returncode == 0, exported.stderr[-3000:]
    result = sweep(runs, "layouts", "--strengths", "1", "--demo", "--height", "64", "--width", "64", "--num_frames",
                   "9", lora="diffsynth-layout.safetensors")   # no run beside the file: its settings given
    assert result.returncode == 0, result.stderr[-3000:]
    for stem in (T2V, I2V):
        key = json.loads((runs / "layouts" / "sweep.json").read_text())["files"][0]["key"]
        assert np.array_equal(clip_frames(runs / "layouts" / key / f"{stem}.mp4"),
                              clip_frames(swept[0] / "step-00000002" / f"{stem}.mp4")), stem


def test_the_best_file_is_the_lowest_validation_loss_and_the_earlier_step_on_a_tie():
    from diffsynth_mbc.sample.sweep_plan import best_file

    files = [{"key": f"step-{step}", "label": f"step-{step}", "path": f"step-{step}.safetensors", "step": step,
              "val_loss": loss} for step, loss in ((2, 0.5), (4, 0.4), (6, 0.4), (8, None))]
    best = best_file(files, 0.8)
    assert best["key"] == "step-4" and best["gain"] == pytest.approx(0.5)
    assert best_file([{**files[0], "val_loss": None}], 0.8) is None
