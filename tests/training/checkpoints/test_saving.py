"""``Checkpoints`` with a real accelerate state on one CPU process: what is written, and what never is."""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.run_layout import SCALER_FILE, checkpoint_folder_name
from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.checkpoints.folder import find_latest, read_manifest
from diffsynth_mbc.training.checkpoints.integrity import damage
from diffsynth_mbc.training.checkpoints.space import CheckpointWriteError, folder_bytes, human, write_failure
from diffsynth_mbc.training.checkpoints.state import Checkpoints, Position
from diffsynth_mbc.training.components.guards import BadMediaGuard
from diffsynth_mbc.training.lora.file_format import NonFiniteLoraError
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.plan.step_plan import lr_factor
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter


TOTAL_STEPS = 10


def build(tmp_path, *flags, data="media"):
    """A run's Checkpoints as ``loop.prepare`` makes them, on one CPU process: model, optimizer, schedule."""
    from accelerate import Accelerator

    from diffsynth_mbc.training.checkpoints.fingerprint import run_fingerprint
    from diffsynth_mbc.training.plan.step_plan import lr_factor

    options = resolve_options(["--demo", "--dataset_base_path", str(tmp_path / data), "--dataset_metadata_path",
                               str(tmp_path / "m.csv"), "--output_path", str(tmp_path / "out"), "--lora_rank", "4",
                               "--keep_checkpoints", "1", *flags])
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    module = WanTI2VLoraModule(build_demo_pipeline(load_encoders=False), lora_rank=4, use_gradient_checkpointing=False)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=options.learning_rate,
                                  weight_decay=options.weight_decay)
    module, optimizer = accelerator.prepare(module, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, TOTAL_STEPS, options.warmup_steps, options.lr_scheduler))
    status = RankStatusWriter(options.log_dir, "run-test", 0, 0, 1)
    fingerprint = run_fingerprint(options, world_size=1, accumulation=1, rows=3, metadata_sha256="abc",
                                  image_batch=5, precision=accelerator.mixed_precision)
    return Checkpoints(accelerator, module, scheduler, options, status, fingerprint=fingerprint), optimizer


@pytest.fixture
def runs(tmp_path):
    from accelerate.state import AcceleratorState

    made = []

    def make(*flags, **kwargs):
        made.append(build(tmp_path, *flags, **kwargs))
        return made[-1]
    try:
        yield make
    finally:
        for checkpoints, _optimizer in made:
            checkpoints.status.close()
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def checkpoints(runs):
    return runs()[0]


def poison(checkpoints, value=float("nan")) -> str:
    """One LoRA weight of the live model set to ``value``, as a run gone wrong would hold it; returns its file key."""
    model = checkpoints.accelerator.unwrap_model(checkpoints.module)
    name = next(n for n, p in model.named_parameters() if p.requires_grad and "blocks.1.self_attn.k.lora_B" in n)
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[3] = value
    return "diffusion_model.blocks.1.self_attn.k.lora_B.weight"


def test_a_lora_holding_nan_is_never_written_and_the_last_good_checkpoint_stays(checkpoints):
    good = checkpoints.save(Position(step=2))
    checkpoints.save_lora("lora.safetensors", 2)
    lora_file = checkpoints.options.output_path + "/lora.safetensors"
    before = load_file(lora_file)
    key = poison(checkpoints)
    with pytest.raises(NonFiniteLoraError, match=r"refusing to write .*step-00000004") as error:
        checkpoints.save(Position(step=4))
    message = str(error.value)
    assert f"1 of 40 LoRA tensors hold NaN or infinite values: {key} (1 NaN, 0 inf of" in message
    assert str(good) in message and "--resume latest" in message
    # Nothing of step 4 exists, the kept-1 pruning never ran, and step 2 is whole.
    assert find_latest(checkpoints.root) == good
    assert sorted(p.name for p in checkpoints.root.iterdir()) == ["step-00000002"]
    assert damage(good, read_manifest(good)) is None
    with pytest.raises(NonFiniteLoraError, match=r"refusing to write .*lora\.safetensors"):
        checkpoints.save_lora("lora.safetensors", 4)
    after = load_file(lora_file)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_an_infinite_value_is_named_too(checkpoints):
    key = poison(checkpoints, float("inf"))
    with pytest.raises(NonFiniteLoraError, match=rf"{key} \(0 NaN, 1 inf of"):
        checkpoints.save_lora("epoch-0.safetensors", 1)
    assert not (checkpoints.root.parent / "epoch-0.safetensors").exists()


def trained_for(checkpoints, optimizer, steps: int, done: int = 0) -> Path:
    """``steps`` more real optimizer and schedule steps (gradients of ones) after ``done``, then a checkpoint."""
    for _ in range(steps):
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                parameter.grad = torch.ones_like(parameter)
        optimizer.step()
        checkpoints.scheduler.step()
    return checkpoints.save(Position(step=done + steps))


def test_changed_optimisation_settings_or_media_are_refused_on_resume(runs):
    trained_for(*runs("--learning_rate", "1e-3"), 3)
    changed = runs("--learning_rate", "1e-2", "--lr_scheduler", "cosine", "--warmup_steps", "1", "--weight_decay",
                   "0", "--max_grad_norm", "0.5", "--min_timestep_boundary", "0.2")[0]
    with pytest.raises(OptionsError) as error:
        changed.load("latest")
    message = str(error.value)
    for line in ("learning_rate: checkpoint 0.001, this run 0.01", "lr_scheduler: checkpoint 'constant', this run "
                 "'cosine'", "warmup_steps: checkpoint 0, this run 1", "weight_decay: checkpoint 0.01, this run 0.0",
                 "max_grad_norm: checkpoint 1.0, this run 0.5", "timestep_boundaries: checkpoint [0.0, 1.0]"):
        assert line in message
    assert "--force_resume true" in message
    other_media = runs("--learning_rate", "1e-3", data="other-media")[0]
    with pytest.raises(OptionsError, match=r"dataset_base_path: checkpoint '.*media', this run '.*other-media'"):
        other_media.load("latest")


def test_force_resume_applies_this_runs_settings_and_says_so(runs, capfd):
    trained_for(*runs("--learning_rate", "1e-3"), 3)
    checkpoints, optimizer = runs("--learning_rate", "1e-2", "--lr_scheduler", "cosine", "--weight_decay", "0",
                                  "--force_resume", "true")
    assert checkpoints.load("latest")[0].step == 3
    expected = 1e-2 * lr_factor(3, TOTAL_STEPS, 0, "cosine")
    assert [group["lr"] for group in optimizer.param_groups] == [pytest.approx(expected)]
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.0]
    checkpoints.scheduler.step()     # and the schedule goes on from this run's rate
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * lr_factor(4, TOTAL_STEPS, 0, "cosine"))
    said = capfd.readouterr().err
    assert "learning_rate: checkpoint 0.001, this run 0.01" in said
    assert "the optimizer now uses this run's learning_rate 0.01 with the cosine schedule" in said
    assert checkpoints.status.state["resumed_with_changes"]


def test_the_same_settings_resume_with_the_saved_optimizer_state(runs):
    first, optimizer = runs("--learning_rate", "1e-3", "--lr_scheduler", "cosine")
    trained_for(first, optimizer, 3)
    saved_lr = optimizer.param_groups[0]["lr"]
    checkpoints, resumed = runs("--learning_rate", "1e-3", "--lr_scheduler", "cosine")
    assert checkpoints.load("latest")[0].step == 3
    assert resumed.param_groups[0]["lr"] == pytest.approx(saved_lr)
    assert checkpoints.status.state.get("resumed_with_changes") is None


def test_a_loss_scaler_starts_fresh_from_a_checkpoint_without_one_and_is_left_aside_by_a_run_without_one(runs,
                                                                                                         capfd):
    """fp16 <-> bf16 on other GPUs (a V100's checkpoint on an H100, and back): accelerate's fp16 loss scaler
    (``scaler.pt``) is in the one checkpoint and not in the other. torch's GradScaler on the CPU stands in for the one
    accelerate makes under fp16 on a GPU (the CPU trains no fp16); the files and the loading are accelerate's own."""
    keep = ("--keep_checkpoints", "5")
    fp16, _ = runs(*keep)
    fp16.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    fp16.save(Position(step=2))
    assert (fp16.root / checkpoint_folder_name(2) / SCALER_FILE).exists()
    bf16, _ = runs(*keep)
    assert bf16.load("latest")[0].step == 2 and bf16.accelerator.scaler is None   # left aside
    bf16.save(Position(step=4))
    assert not (bf16.root / checkpoint_folder_name(4) / SCALER_FILE).exists()
    again, _ = runs(*keep)
    fresh = again.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    capfd.readouterr()
    assert again.load("latest")[0].step == 4
    assert again.accelerator.scaler is fresh and fresh.get_scale() == 65536.0
    assert capfd.readouterr().err.count("holds no loss scaler (it was saved without fp16): the loss scaler starts "
                                        "fresh") == 1
    again.load(str(fp16.root / checkpoint_folder_name(2)))   # an fp16 checkpoint's scaler comes back under fp16
    assert fresh.get_scale() == 256.0


def test_a_resume_goes_on_counting_what_each_rank_replaced(runs):
    """The summary counts and names the bad media of the whole run: a resume's counters come from the checkpoint."""
    checkpoints, _optimizer = runs()
    replaced = {"9": ["media/image_002.png", 3]}
    guard = BadMediaGuard(0.01)
    guard.load_state_dict({"skipped_samples": 3, "recent_skips": [], "replaced": replaced})
    checkpoints.save(Position(step=2, samples_seen=40), [guard])
    position, states, vanished = runs()[0].load("latest")
    resumed = BadMediaGuard(0.01)
    resumed.load_state_dict(states["bad_media"])
    assert (position.samples_seen, resumed.skipped_samples, resumed.replaced, vanished) == (40, 3, replaced, [])


def test_rank_0_takes_over_the_counts_of_the_ranks_a_resume_on_fewer_processes_does_not_have():
    """A 3-rank checkpoint resumed on 1: what ranks 1 and 2 replaced is rank 0's now (the run's summary names it)."""
    from diffsynth_mbc.training.checkpoints.state import component_states, vanished_rank_states

    def rank(skipped, replaced):
        return {"samples_seen": 10, "components": {"bad_media": {"skipped_samples": skipped, "recent_skips": [
            {"row": int(row), "file": file, "reason": "undecodable"} for row, (file, _) in replaced.items()],
            "replaced": replaced}}}

    manifest = {"components": {}, "per_rank": [rank(1, {"3": ["a.mp4", 1]}), rank(2, {"3": ["a.mp4", 2]}),
                                               rank(1, {"7": ["b.mp4", 1]})]}
    assert vanished_rank_states(manifest, 3) == [] and len(vanished_rank_states(manifest, 1)) == 2
    guard = BadMediaGuard(0.01)
    guard.load_state_dict(component_states(manifest, 0)["bad_media"])
    for states in vanished_rank_states(manifest, 1):
        guard.take_over(states["bad_media"])
    assert guard.skipped_samples == 4 and guard.replaced == {"3": ["a.mp4", 3], "7": ["b.mp4", 1]}
    assert [skip["file"] for skip in guard.recent_skips] == ["a.mp4", "a.mp4", "b.mp4"]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs of this test's own: a disk that really fills up. Needs the right to mount."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here to fill a disk for real: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        # A writer that failed may still hold a file open until it is collected: detach lazily then.
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)


def test_a_full_disk_names_the_folder_and_the_space_removes_the_partial_checkpoint_and_keeps_the_last(
        runs, tiny_disk):
    checkpoints, optimizer = runs("--checkpoint_dir", str(tiny_disk / "checkpoints"), "--keep_checkpoints", "3")
    good = trained_for(checkpoints, optimizer, 2)
    size = folder_bytes(good)
    # Leave room for half a checkpoint: the next one starts writing and runs out part-way.
    free = shutil.disk_usage(tiny_disk).free
    (tiny_disk / "filler").write_bytes(b"\0" * (free - size // 2))
    with pytest.raises(CheckpointWriteError) as error:
        trained_for(checkpoints, optimizer, 2, done=2)
    message = str(error.value)
    assert message.startswith(f"could not write checkpoint step-00000004 in {tiny_disk / 'checkpoints'}: no space "
                              "left on that filesystem")
    assert f"a checkpoint needs about {human(size)}" in message and f"previous checkpoint {good} is intact" in message
    assert sorted(p.name for p in (tiny_disk / "checkpoints").iterdir()) == ["step-00000002"]
    assert damage(good, read_manifest(good)) is None and find_latest(tiny_disk / "checkpoints") == good


@pytest.mark.parametrize("error", [
    "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4308",
    "RuntimeError: PytorchStreamWriter failed writing file data/0: file write failed",
    "SafetensorError: Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space\" })",
    OSError(errno.ENOSPC, "No space left on device"),
])
def test_what_writers_say_on_a_full_disk_is_called_no_space(tmp_path, error):
    message = write_failure("step-00000008", tmp_path, error, free=1000, needed=3 * 2**20, previous=tmp_path / "s4")
    assert message.startswith(f"could not write checkpoint step-00000008 in {tmp_path}: no space left")
    assert "1000 bytes free, a checkpoint needs about 3.0 MiB" in message and "s4 is intact" in message


def test_other_write_failures_are_not_called_a_full_disk(tmp_path):
    message = write_failure("step-00000008", tmp_path, PermissionError(13, "Permission denied"), free=2**30,
                            needed=2**20, previous=None)
    assert "no space" not in message and "Permission denied" in message and "no earlier checkpoint" in message
    # A torch write failure with plenty of room is not a full disk either.
    assert "no space" not in write_failure("s", tmp_path, "RuntimeError: iostream error", free=2**30, needed=2**20,
                                           previous=None)
