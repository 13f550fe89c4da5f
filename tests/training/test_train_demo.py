"""The real path on 2 CPU processes: launcher -> convert -> accelerate (gloo) -> per-rank files -> LoRA."""

import json
import subprocess
import sys
import time
import types

import psutil
import pytest
import torch

from diffsynth_mbc.training.plan.batches import epoch_batches
from diffsynth_mbc.training.plan.step_plan import StepPlan
from e2e_helpers import REPO, isolated_env, read_history, read_status

pytestmark = pytest.mark.slow
DEMO_ROWS, DEMO_REPEAT, DEMO_ACCUMULATION, DEMO_EPOCHS = 11, 3, 2, 2   # configs/train_demo.yaml
DEMO_KEYS = ["video"] * 6 + ["image"] * 5     # the demo catalogue's rows; images batch by 3 (9 frames)
DEMO_SEED = 42


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One demo run; a stale lock is left beforehand and a second launch is tried while it runs."""
    work = tmp_path_factory.mktemp("demo")
    env = isolated_env(work, OMP_NUM_THREADS=1, COLUMNS=80)   # an 80-column terminal's width
    output = work / "runs" / "demo" / "lora"
    output.mkdir(parents=True)
    (output / ".train.pid").write_text("999999\n")          # left by a run that died without cleaning up
    launcher = ["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--report_to", "tensorboard"]
    first = subprocess.Popen(launcher, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_dir = work / "runs" / "demo" / "training_logs"
    deadline = time.monotonic() + 120
    while not (log_dir / "training_gpu1.json").exists():
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "the demo never started its ranks"
        time.sleep(0.2)
    refused = subprocess.Popen(launcher, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = refused.communicate(timeout=120)
    second = types.SimpleNamespace(pid=refused.pid, returncode=refused.returncode, stdout=out, stderr=err)
    trainers_while_second_tried = _trainer_processes_in(work)
    first_output, _ = first.communicate(timeout=300)
    return {"work": work, "log_dir": log_dir, "output": output, "code": first.returncode, "log": first_output,
            "second": second, "trainers": trainers_while_second_tried}


def _trainer_processes_in(work) -> int:
    """Rank processes of the run under test only: `python -u -m diffsynth_mbc.train ...` (as accelerate starts
    each rank) whose working folder is this test's own, so trainings elsewhere on the machine never count."""
    count = 0
    for process in psutil.process_iter(["cmdline", "cwd"]):
        cmdline, cwd = process.info["cmdline"] or [], process.info["cwd"]
        if cwd == str(work) and cmdline[1:4] == ["-u", "-m", "diffsynth_mbc.train"]:
            count += 1
    return count


def test_demo_finishes(demo):
    assert demo["code"] == 0, demo["log"][-4000:]
    for rank in (0, 1):
        assert read_status(demo["log_dir"], rank)["status"] == "finished"


def test_each_rank_writes_its_own_files(demo):
    states = [read_status(demo["log_dir"], rank) for rank in (0, 1)]
    assert [s["rank"] for s in states] == [0, 1]
    assert all(s["world_size"] == 2 for s in states)
    assert states[0]["pid"] != states[1]["pid"]
    assert states[0]["run_id"] == states[1]["run_id"]
    assert sorted(p.name for p in demo["log_dir"].iterdir() if not p.name.startswith(".train")) == [
        "training_gpu0.json", "training_gpu0.jsonl", "training_gpu1.json", "training_gpu1.jsonl"]


def test_totals_match_the_formula_with_repeat_odd_rows_and_accumulation(demo):
    plan = StepPlan(DEMO_ROWS, DEMO_REPEAT, world_size=2, batch_size=1, gradient_accumulation=DEMO_ACCUMULATION,
                    num_epochs=DEMO_EPOCHS, images=5, image_batch_size=3)
    assert plan.total_steps == 12
    sizes = {"video": 1, "image": 3}
    for rank in (0, 1):
        state = read_status(demo["log_dir"], rank)
        assert state["total_steps"] == state["step"] == plan.total_steps
        assert state["steps_per_epoch"] == plan.steps_per_epoch
        # Each rank counts the samples of the batches dealt to it (images come 3 to a batch).
        dealt = sum(len(batch) for epoch in range(DEMO_EPOCHS)
                    for batch in epoch_batches(DEMO_KEYS, DEMO_REPEAT, sizes, 2, DEMO_SEED, epoch)[rank::2])
        assert state["samples_seen"] == dealt
        assert state["progress"] == 100.0
    assert f"{plan.steps_per_epoch} optimizer steps per GPU per epoch" in demo["log"]
    assert f"{plan.total_steps} steps in total" in demo["log"]


def test_the_launcher_the_training_and_the_status_files_plan_the_same_steps(demo):
    """The launcher printed '18 steps in total' (images batched by 1), the training planned and ran 12."""
    import re

    totals = re.findall(r"([\d,]+) steps in total", demo["log"])
    launcher = [line for line in demo["log"].splitlines() if line.startswith("step plan: ") and "rows" not in line]
    training = [line for line in demo["log"].splitlines() if line.startswith("step plan: 11 rows")]
    assert len(launcher) == len(training) == 1 and len(totals) == 2, demo["log"][:3000]
    assert totals == ["12", "12"]
    for rank in (0, 1):
        assert read_status(demo["log_dir"], rank)["plan"]["total_steps"] == 12


def test_before_the_training_speaks_the_launcher_prints_a_few_lines_within_80_columns(demo):
    """At 80 columns the pre-run block wrapped to about 25 lines; the detail now goes to the run's log."""
    lines = demo["log"].splitlines()
    block = lines[:next(i for i, line in enumerate(lines) if line.startswith("watch: ")) + 1]
    assert len(block) <= 12 and all(len(line) <= 80 for line in block), "\n".join(block)
    for wanted in ("step plan: 12 steps in total per GPU", "  modes/epoch: ", "preflight: ", "run run-", "log: ",
                   "watch: python -m diffsynth_mbc.monitor runs/demo/training_logs"):
        assert any(line.startswith(wanted) for line in block), (wanted, block)
    run_id = read_status(demo["log_dir"], 0)["run_id"]
    log = (demo["output"] / f"train-{run_id}.log").read_text()
    assert f"log: runs/demo/lora/train-{run_id}.log" in block
    for detail in ("demo: writes its catalogue and metadata under",                                # paths, the data
                   "demo metadata: runs/demo/metadata/metadata.csv",
                   "  rows 11 (6 videos + 5 images) x repeat 3 = 33 samples per epoch",          # the full plan
                   "  ok: model files: demo", "  warn: GPU: no CUDA GPU",                        # every check
                   f"run {run_id}: env ACCELERATE_USE_CPU=1", "-m accelerate.commands.launch"):   # the command
        assert detail in log, detail
    assert "-m accelerate.commands.launch" not in "\n".join(block)


def test_epoch_lora_files_are_numbered_as_the_terminal_counts_epochs(demo):
    assert "epoch 1/2 done" in demo["log"] and "epoch 2/2 done" in demo["log"]
    assert sorted(p.name for p in demo["output"].glob("epoch-*")) == ["epoch-001.safetensors", "epoch-002.safetensors"]


def test_history_has_one_line_per_optimizer_step(demo):
    for rank in (0, 1):
        history = read_history(demo["log_dir"], rank)
        assert [line["step"] for line in history] == list(range(1, 13))
        assert all(line["loss"] is not None and line["lr"] > 0 for line in history)
        # throughput in tokens too: a 9-frame 64x64 clip is 3 x 2 x 2 = 12 DiT tokens, an image 4
        assert all(line["tokens"] > 0 and line["tokens"] % 4 == 0 for line in history)
        assert read_status(demo["log_dir"], rank)["tokens_per_s"] > 0
        assert [line["epoch"] for line in history] == [0] * 6 + [1] * 6


def test_every_step_record_names_each_samples_mode_images_t2i_videos_i2v(demo):
    """The default objective: an image trains text-to-image, a video image-to-video (--i2v_probability 1)."""
    for rank in (0, 1):
        history = read_history(demo["log_dir"], rank)
        for line in history:
            modes = line["modes"]
            assert len(modes) == len(line["timesteps"]) == len(line["timestep_losses"]) > 0
            assert set(modes) <= {"t2i", "i2v"}
            # a 9-frame 64x64 clip is 12 DiT tokens, an image 4: the modes account for every token of the step
            assert line["tokens"] == 12 * modes.count("i2v") + 4 * modes.count("t2i"), line
        seen = {mode for line in history for mode in line["modes"]}
        assert seen == {"t2i", "i2v"}
        assert read_status(demo["log_dir"], rank)["plan"]["modes_per_epoch"] == {"t2i": 15, "i2v": 18, "t2v": 0}
    assert "modes per epoch: 15 t2i (images) + 18 i2v" in demo["log"]


def test_every_step_record_names_its_metadata_rows_and_each_epoch_trains_every_row_as_planned(demo):
    """`rows`: the 0-based metadata row of each sample of the step, in the order of its `modes`. Over both ranks an
    epoch trains each row its 3 copies (--dataset_repeat 3), and the copies the padding repeats, nothing else."""
    from collections import Counter

    sizes = {"video": 1, "image": 3}
    for epoch in range(DEMO_EPOCHS):
        trained = Counter()
        for rank in (0, 1):
            for line in read_history(demo["log_dir"], rank):
                assert len(line["rows"]) == len(line["modes"]) == line["samples"], line
                assert all(line["modes"][i] == ("i2v" if DEMO_KEYS[row] == "video" else "t2i")
                           for i, row in enumerate(line["rows"]))
                if line["epoch"] == epoch:
                    trained.update(line["rows"])
        planned = Counter(index % DEMO_ROWS for batch in epoch_batches(DEMO_KEYS, DEMO_REPEAT, sizes, 2, DEMO_SEED,
                                                                       epoch) for index in batch)
        assert trained == planned, epoch
        assert set(trained) == set(range(DEMO_ROWS)) and all(count >= DEMO_REPEAT for count in trained.values())


def test_gradients_are_averaged_across_ranks(demo):
    """Different samples and noise on each rank, yet one averaged gradient: DDP really wraps the model."""
    norms = [[line["grad_norm"] for line in read_history(demo["log_dir"], rank)] for rank in (0, 1)]
    assert all(n is not None and n > 0 for n in norms[0])
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)


def test_ranks_draw_different_noise(demo):
    losses = [[line["loss"] for line in read_history(demo["log_dir"], rank)] for rank in (0, 1)]
    assert losses[0] != losses[1]


def test_second_launch_is_refused_while_the_first_runs(demo):
    assert demo["second"].returncode == 75
    assert "already running" in demo["second"].stderr
    # It names the live run's processes only: the refused launcher holds the lock file open too, and was listed.
    assert f" {demo['second'].pid}" not in demo["second"].stderr.split("already running")[1], demo["second"].stderr
    assert demo["trainers"] <= 2, "more than two training processes were alive at once"


def test_the_launcher_terminal_shows_progress_and_a_summary(demo):
    """Without a terminal, rank 0 prints progress lines (step/total, ETA) while it trains and a summary."""
    import re

    progress = [line for line in demo["log"].splitlines() if re.match(r"^(epoch \d/2 done \| )?step \d+/12 ", line)]
    assert progress and all("ETA" in line and "loss" in line for line in progress)
    assert any(line.startswith("epoch 2/2 done | step 12/12 (100.0%)") for line in progress)
    assert "finished: 12/12 steps in" in demo["log"]
    assert "watch or inspect: python -m diffsynth_mbc.monitor runs/demo/training_logs" in demo["log"]


def test_tensorboard_scalars_equal_the_history(demo):
    """--report_to tensorboard: rank 0's scalars, read back with TensorBoard's own reader, are the JSONL's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_id = read_status(demo["log_dir"], 0)["run_id"]
    events = EventAccumulator(str(demo["output"] / "tracking" / run_id))
    events.Reload()
    history = read_history(demo["log_dir"], 0)
    for key in ("loss", "lr", "grad_norm", "step_time_s"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        assert sorted(logged) == [line["step"] for line in history]
        assert [logged[line["step"]] for line in history] == pytest.approx([line[key] for line in history],
                                                                           rel=1e-6, abs=1e-12)
    rated = [e.step for e in events.Scalars("samples_per_s")]   # from the first step after the rate's warm-up
    assert rated and rated == [line["step"] for line in history][-len(rated):]


def test_known_third_party_noise_is_filtered(demo):
    for noise in ("pynvml package is deprecated", "torch.jit.script` is deprecated", "Setting accelerator to CPU"):
        assert noise not in demo["log"]
    assert demo["log"].count("Height and width are fixed") <= 1   # DiffSynth's notice: once, rank 0 only


def test_stale_lock_is_detected_and_cleared(demo):
    assert "cleared a stale lock of pid 999999" in demo["log"]
    assert not (demo["output"] / ".train.pid").exists()


def test_lora_loads_with_diffsynth_loader_and_changes_the_dit(demo):
    from safetensors.torch import load_file

    from diffsynth_mbc.models.pipeline import build_demo_pipeline

    lora_path = demo["output"] / "lora.safetensors"
    lora = load_file(str(lora_path))
    # The ComfyUI layout by default (alpha/rank folded in), which DiffSynth's loader reads as well.
    assert lora and all(k.startswith("diffusion_model.blocks.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
                        for k in lora)
    assert any(k.startswith("diffusion_model.blocks.0.self_attn.q.") for k in lora) and any(".ffn.2." in k for k in lora)
    assert any(lora[k].abs().sum() > 0 for k in lora if "lora_B" in k), "LoRA B is still zero: nothing trained"

    pipe = build_demo_pipeline(seed=42, load_encoders=False)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 48, 3, 4, 4, generator=generator)
    context = torch.randn(1, 8, 32, generator=generator)
    timestep = torch.tensor([500.0])
    with torch.no_grad():
        before = pipe.dit(latents, timestep, context)
        pipe.load_lora(pipe.dit, str(lora_path))     # DiffSynth's own GeneralLoRALoader merges it
        after = pipe.dit(latents, timestep, context)
    assert not torch.allclose(before, after)


def test_monitor_reads_the_real_run(demo):
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.monitor", str(demo["log_dir"]), "--once", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["status"] == "finished" and summary["world_size"] == 2
    assert summary["step"] == summary["total_steps"] == 12
    assert summary["missing_ranks"] == [] and summary["stalled_ranks"] == []
