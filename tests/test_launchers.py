"""The launchers: help, flag pass-through, one run per folder, unique run ids, stop.sh, dead ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from catalog_helpers import clip, write_metadata
from diffsynth_mbc import run_layout
from diffsynth_mbc.lifecycle.stop_command import lock_holders
from diffsynth_mbc.training.options import build_parser
from diffsynth_mbc.training.plan import command as plan
from e2e_helpers import REPO, a_preset_s_files, a_value_for, isolated_env, read_status

LAUNCHER = str(REPO / "launchers" / "train_test.sh")
DEMO_PRESET = str(REPO / "configs" / "train_demo.yaml")


def launcher(work, *args, timeout=120, **env):
    return subprocess.run(["bash", LAUNCHER, *args], cwd=work, env=isolated_env(work, **env),
                          capture_output=True, text=True, timeout=timeout)


def test_help_prints_the_launcher_flags_then_the_training_flags(tmp_path):
    result = launcher(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "command not found" not in result.stderr and "running the built-in demo" not in result.stderr
    assert text.index("--cached") < text.index("--dry_run") < text.index("usage: python -m diffsynth_mbc.train")
    assert "--learning_rate" in text and "launchers/stop.sh" in text


def test_the_launchers_spell_the_run_files_as_the_run_layout_does():
    """The three names the launchers spell themselves (bash cannot import them): each node's lock, the launch's log
    and the status files the log points to."""
    common = REPO / "launchers" / "common.sh"
    for node, multinode in ((0, "0"), (0, "1"), (3, "1")):
        shell = subprocess.run(["bash", "-c", f'source "{common}" && mbc_lock_name'], capture_output=True, text=True,
                               env={**os.environ, "MACHINE_RANK": str(node), "MBC_MULTINODE": multinode}, check=True)
        assert shell.stdout.strip() == run_layout.lock_name(node if multinode == "1" else 0)
    text = common.read_text()
    log = re.search(r'log_file=\$\{MBC_LOG_FILE:-\$OUTPUT_PATH/([^}]+)\}', text)
    assert log and log.group(1) == run_layout.run_log_name("$MBC_RUN_ID")
    assert f"$LOG_DIR/{run_layout.STATUS_FILE_GLOB}" in text
    record = re.search(r"pid_file=(\S+)", text).group(1)   # the launcher's record beside its lock
    lock = run_layout.lock_name(3)
    shell = subprocess.run(["bash", "-c", f"lock={lock}; echo {record}"], capture_output=True, text=True, check=True)
    assert shell.stdout.strip() == run_layout.lock_record_name(lock)


def training_flags():
    parser = build_parser()
    for action in parser._actions:
        long = [flag for flag in action.option_strings if flag.startswith("--")]
        if long and long[0] not in ("--help", "--config"):
            yield long[0], a_value_for(action)


@pytest.mark.parametrize("flag,value", list(training_flags()))
def test_every_training_flag_passes_through_the_plan_step(flag, value, capsys):
    """The launcher validates flags with `python -m diffsynth_mbc.plan`; no flag may be taken for one of its own
    (prefix matching once read `--cache DIR` as `--cache-commands`)."""
    code = plan.main(["--paths-only", "--world_size", "2", "--config", DEMO_PRESET, flag, *value])
    error = capsys.readouterr().err
    assert "unrecognized arguments" not in error and "ambiguous option" not in error, error
    if code != 0:   # a value the options reject on their own terms names the flag, never the plan's parser
        assert flag.lstrip("-").split("_")[0] in error or "--demo" in error, error


@pytest.mark.slow
def test_training_flags_reach_the_training_command(tmp_path):
    for cache in ("cache/mbc", "cache/val"):   # a dry run checks that the folders the training reads are there
        (tmp_path / cache).mkdir(parents=True)
    result = launcher(tmp_path, "--demo", "--dry-run", "--cache", "cache/mbc", "--val_cache", "cache/val",
                      "--learning_rate", "0.01", "--lora_alpha", "8", "--output_path", "runs/x/lora")
    assert result.returncode == 0, result.stderr
    command = result.stdout.splitlines()[0]
    for part in ("--cache cache/mbc", "--val_cache cache/val", "--learning_rate 0.01", "--lora_alpha 8",
                 "--output_path runs/x/lora", "-m diffsynth_mbc.train"):
        assert part in command
    assert not (tmp_path / "runs").exists()                      # a dry run creates nothing


@pytest.mark.slow
def test_a_failing_preflight_check_stops_the_launch_before_any_process_starts(tmp_path):
    """fp16 on a machine without a GPU: the quick doctor fails, names the check and --skip_doctor."""
    result = launcher(tmp_path, "--demo", "--mixed_precision", "fp16", timeout=300)
    assert result.returncode == 2
    assert "fail: precision: --mixed_precision fp16 needs a CUDA GPU" in result.stderr
    assert "preflight checks above failed" in result.stderr and "--skip_doctor" in result.stderr
    assert not list((tmp_path / "runs" / "demo").glob("training_logs/training_gpu*.json"))   # nothing launched
    # ... and it leaves no run record behind (the next launch used to report a "stale lock" it had left)
    assert not list((tmp_path / "runs" / "demo").rglob(".train*.pid"))
    skipped = launcher(tmp_path, "--demo", "--mixed_precision", "fp16", "--skip_doctor", timeout=300)
    assert "preflight checks" not in skipped.stderr   # launched anyway: the training itself refuses, with the same words
    assert "fp16 needs a CUDA GPU" in skipped.stdout + skipped.stderr
    # Each rank refuses on its own; the first to fail ends the launch, and torchrun stops a rank that has not got
    # there yet (its file, if it wrote one, says "stopped"). The run is recorded failed, with the refusal.
    logs = tmp_path / "runs" / "demo" / "training_logs"
    states = [read_status(logs, rank) for rank in (0, 1) if (logs / f"training_gpu{rank}.json").exists()]
    assert {state["status"] for state in states} <= {"failed", "stopped"}, states
    assert any(state["status"] == "failed" and "fp16 needs a CUDA GPU" in state["error"]["message"]
               for state in states), states


@pytest.mark.parametrize("preset,output", [("train_test.sh", "runs/test/lora"), ("train_full.sh", "runs/full/lora")])
def test_presets_keep_their_logs_under_their_own_output_folder(tmp_path, preset, output):
    media = a_preset_s_files(tmp_path)
    result = subprocess.run(["bash", str(REPO / "launchers" / preset), "--dry-run", "--gpus", "2",
                             "--dataset_base_path", str(media)], cwd=tmp_path,
                            env=isolated_env(tmp_path, MODEL_DIR="models/Wan2.2-TI2V-5B"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"output: {output}   logs: {output}/training_logs   checkpoints: {output}/checkpoints" in result.stdout


def test_the_demo_with_model_dir_in_the_environment_names_the_variable_and_writes_nothing(tmp_path):
    """MODEL_DIR set in the shell and --demo: the refusal said "do not combine it with --model_dir ...", a flag the
    user never typed."""
    result = subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo"], cwd=tmp_path,
                            env=isolated_env(tmp_path, MODEL_DIR="models/Wan2.2-TI2V-5B"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert ("error: --demo builds a tiny random model, but MODEL_DIR is set in the environment "
            "(models/Wan2.2-TI2V-5B): unset it for the demo") in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_dry_run_from_another_folder_names_the_missing_path_and_the_folder_it_was_resolved_against(tmp_path):
    """From another folder `train_full.sh --dry-run` said "would run ..." (exit 0); the launch failed on
    data/mbc_full/metadata.csv."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(["bash", str(REPO / "launchers" / "train_full.sh"), "--dry-run", "--gpus", "2"],
                            cwd=elsewhere, env=isolated_env(tmp_path, MODEL_DIR="models/Wan2.2-TI2V-5B"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "would run" not in result.stdout
    assert (f"error: --dataset_metadata_path data/mbc_full/metadata.csv: no such file: "
            f"{elsewhere}/data/mbc_full/metadata.csv (resolved against the current folder {elsewhere})") \
        in result.stderr, result.stderr
    assert not list(elsewhere.iterdir())


@pytest.mark.slow
def test_a_dry_run_prints_every_path_the_run_reads_resolved(tmp_path):
    media = a_preset_s_files(tmp_path)
    (tmp_path / "prompts.txt").write_text("a cat\n")
    result = subprocess.run(["bash", str(REPO / "launchers" / "train_full.sh"), "--dry-run", "--gpus", "2",
                             "--dataset_base_path", str(media), "--sample_prompts", "prompts.txt"], cwd=tmp_path,
                            env=isolated_env(tmp_path, MODEL_DIR="models/Wan2.2-TI2V-5B"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"relative paths are taken from the current folder, {tmp_path}" in result.stdout
    for key, path in (("dataset_metadata_path", "data/mbc_full/metadata.csv"), ("dataset_base_path", "media"),
                      ("model_dir", "models/Wan2.2-TI2V-5B"), ("val_metadata_path", "data/mbc_full/metadata_val.csv"),
                      ("sample_prompts", "prompts.txt")):
        line, = [line for line in result.stdout.splitlines() if line.strip().startswith(f"--{key} ")]
        assert line.split()[-1] == str(tmp_path / path), line
    (tmp_path / "data/mbc_full/metadata_val.csv").unlink()   # each of them is checked, the validation's too
    again = subprocess.run(["bash", str(REPO / "launchers" / "train_full.sh"), "--dry-run", "--gpus", "2",
                            "--dataset_base_path", str(media)], cwd=tmp_path,
                           env=isolated_env(tmp_path, MODEL_DIR="models/Wan2.2-TI2V-5B"),
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "--val_metadata_path data/mbc_full/metadata_val.csv: no such file" in again.stderr


@pytest.mark.slow
def test_the_demo_says_where_it_writes(tmp_path):
    result = launcher(tmp_path, "--demo", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"demo: writes its catalogue and metadata under {tmp_path}/runs/demo, the run under {tmp_path}/runs/demo/lora" \
        in result.stdout


@pytest.mark.slow
def test_a_dry_run_of_the_demo_prints_the_step_plan_a_launch_prints(tmp_path):
    """`--dry_run --demo` printed no plan (the demo's catalogue is made only by a real launch)."""
    result = launcher(tmp_path, "--demo", "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "step plan: 12 steps in total per GPU (6 x 2 epochs, 2 GPUs)" in lines, result.stderr
    assert "  modes/epoch: 15 t2i (images) + 18 i2v (videos: --i2v_probability 1)" in lines
    assert not (tmp_path / "runs").exists()                                 # still creates nothing
    assert not list((tmp_path / ".cache" / "tmpdir").iterdir())             # its scratch catalogue is gone


def test_the_demo_runs_as_many_cpu_processes_as_gpus_asks(tmp_path):
    """`--demo --gpus 3` ran 2 processes without a word."""
    three = launcher(tmp_path, "--demo", "--dry-run", "--gpus", "3")
    assert three.returncode == 0, three.stderr
    assert "--multi_gpu --num_processes 3 " in three.stdout and "gpus=3 " in three.stdout
    assert "step plan: 8 steps in total per GPU (4 x 2 epochs, 3 GPUs)" in three.stderr.splitlines(), three.stderr
    one = launcher(tmp_path, "--demo", "--dry-run", "--gpus", "1")
    assert one.returncode == 0 and "--num_processes 1 " in one.stdout and "--multi_gpu" not in one.stdout
    bad = launcher(tmp_path, "--demo", "--dry-run", "--gpus", "two")
    assert bad.returncode != 0 and "--gpus: expected a number of processes, got 'two'" in bad.stderr


@pytest.mark.slow
def test_the_demo_says_what_it_trains_on_and_writes_only_its_own_catalogue(tmp_path):
    """`--demo --dataset_base_path X` said it wrote its catalogue under X and wrote runs/demo. Given a catalogue
    (its metadata), the demo model trains on it and writes none; a base folder alone is refused."""
    alone = launcher(tmp_path, "--demo", "--dry-run", "--dataset_base_path", "mine/catalog")
    assert alone.returncode == 2, alone.stdout + alone.stderr
    line, = alone.stderr.splitlines()
    assert line.startswith("error: --demo with --dataset_base_path but no --dataset_metadata_path: "), line
    assert "runs/demo" in line and "would run" not in alone.stdout
    (tmp_path / "mine" / "catalog").mkdir(parents=True)
    write_metadata(tmp_path / "mine" / "metadata.csv", [clip("v.mp4")] * 4)
    (tmp_path / "mine" / "catalog" / "v.mp4").write_bytes(b"")   # there (a run whose files are all missing is refused)
    given = launcher(tmp_path, "--demo", "--dry-run", "--dataset_base_path", "mine/catalog",
                     "--dataset-metadata-path=mine/metadata.csv")
    assert given.returncode == 0, given.stderr
    assert (f"demo: the demo model trains on {tmp_path}/mine/metadata.csv (no catalogue of its own written), the run "
            f"under {tmp_path}/runs/demo/lora") in given.stdout
    assert "writes its catalogue" not in given.stdout
    read = [line.split() for line in given.stdout.splitlines() if line.startswith("  --")]
    assert ["--dataset_metadata_path", str(tmp_path / "mine" / "metadata.csv")] in read, given.stdout
    # the plan counts the given rows: 4 videos x repeat 3 on 2 GPUs, accumulation 2 -> 3 steps an epoch, 2 epochs
    assert "step plan: 6 steps in total per GPU (3 x 2 epochs, 2 GPUs)" in given.stderr, given.stderr
    assert not (tmp_path / "runs").exists()
    missing = launcher(tmp_path, "--demo", "--dry-run", "--dataset_metadata_path", "mine/nothing.csv")
    assert missing.returncode == 2 and "--dataset_metadata_path mine/nothing.csv: no such file" in missing.stderr


def test_the_reads_list_names_every_catalogue_of_a_datasets_list(tmp_path):
    """The launcher's 'reads:' left out the catalogues of a `datasets:` list (their paths only showed as the
    combined metadata the run writes from them)."""
    media = a_preset_s_files(tmp_path)
    for name in ("news", "drama"):
        (tmp_path / "data" / name / "media").mkdir(parents=True)
        write_metadata(tmp_path / "data" / name / "metadata.csv", [clip("a.mp4")])
        (tmp_path / "data" / name / "media" / "a.mp4").write_bytes(b"")   # there: missing, the run is refused
    (tmp_path / "datasets.yaml").write_text(
        "- {base_path: data/news/media, metadata_path: data/news/metadata.csv}\n"
        "- {base_path: data/drama/media, metadata_path: data/drama/metadata.csv, repeat: 3}\n")
    result = subprocess.run(["bash", str(REPO / "launchers" / "train_full.sh"), "--dry-run", "--gpus", "2",
                             "--datasets", "datasets.yaml", "--output_path", "out/lora"], cwd=tmp_path,
                            env=isolated_env(tmp_path, MODEL_DIR="models/Wan2.2-TI2V-5B"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    read = {" ".join(line.split()[:-1]): line.split()[-1] for line in result.stdout.splitlines()
            if line.startswith("  ")}
    for position, name in enumerate(("news", "drama")):
        assert read[f"datasets[{position}] base_path"] == str(tmp_path / "data" / name / "media"), read
        assert read[f"datasets[{position}] metadata_path"] == str(tmp_path / "data" / name / "metadata.csv")
    assert read["--model_dir"] == str(tmp_path / "models" / "Wan2.2-TI2V-5B") and str(media) not in read.values()
    # 1 + 3 x 1 samples (drama's repeat) on 2 GPUs: 2 steps an epoch, 5 epochs
    assert "step plan: 10 steps in total per GPU (2 x 5 epochs, 2 GPUs)" in result.stderr


def test_stop_sh_help_names_stop_sh(tmp_path):
    result = subprocess.run(["bash", str(REPO / "launchers" / "stop.sh"), "--help"], cwd=tmp_path,
                            env=isolated_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: bash {REPO}/launchers/stop.sh "), result.stdout   # as typed
    typo = subprocess.run(["bash", str(REPO / "launchers" / "stop.sh"), "runs/x", "--grce", "3"], cwd=tmp_path,
                          env=isolated_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and f"(full list: bash {REPO}/launchers/stop.sh --help)" in typo.stderr, typo.stderr


def test_the_commands_a_launch_from_another_folder_prints_work_there(tmp_path):
    """`bash main/launchers/train_test.sh ...` printed `bash launchers/train_test.sh ...` commands, which fail in the
    folder it was started in: each names the launcher (and stop.sh beside it) as it was typed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    typed = os.path.relpath(LAUNCHER, elsewhere)
    stop = os.path.join(os.path.dirname(typed), "stop.sh")
    typo = subprocess.run(["bash", typed, "--demo", "--lr", "3"], cwd=elsewhere, env=isolated_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and f"(full list: bash {typed} --help)" in typo.stderr, typo.stderr
    shown = subprocess.run(["bash", typed, "--help"], cwd=elsewhere, env=isolated_env(tmp_path),
                           capture_output=True, text=True, timeout=120)   # the command it printed, run there
    assert shown.returncode == 0 and shown.stdout.startswith(f"usage: bash {typed} "), shown.stderr
    folder = tmp_path / "shared"
    holder = hold_lock(folder, "run-A")
    try:
        refused = subprocess.run(["bash", typed, "--demo", "--output_path", str(folder)], cwd=elsewhere,
                                 env=isolated_env(tmp_path), capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 75 and f"stop it with: bash {stop} {folder}" in refused.stderr, refused.stderr
    usage = subprocess.run(["bash", stop, "--help"], cwd=elsewhere, env=isolated_env(tmp_path),
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith(f"usage: bash {stop}"), usage.stderr


def hold_lock(folder, run_id):
    """A stand-in for a live run on ``folder``: a process holding its lock, and the run's pid file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".train.pid").write_text(f"4242\n{run_id}\n")
    holder = subprocess.Popen(["flock", "-n", str(folder / ".train.lock"), "sleep", "60"])
    deadline = time.monotonic() + 10
    while not lock_holders(folder / ".train.lock"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return holder


@pytest.mark.parametrize("shared,what", [("log_dir", "log folder"), ("checkpoint_dir", "checkpoint folder")])
def test_a_second_run_on_a_shared_folder_is_refused_naming_the_running_one(tmp_path, shared, what):
    folder = tmp_path / "shared"
    holder = hold_lock(folder, "run-A")
    try:
        result = launcher(tmp_path, "--demo", f"--{shared}", str(folder), "--output_path", "runs/b/lora")
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 75, result.stderr
    assert f"already running on {folder} (its {what}): run run-A" in result.stderr
    assert "ranks" in result.stderr or f"processes {holder.pid}" in result.stderr
    assert "launchers/stop.sh" in result.stderr
    assert (folder / ".train.pid").read_text() == "4242\nrun-A\n"   # the running run's record is untouched


def test_run_ids_of_launches_in_the_same_second_differ():
    script = f'source "{REPO}/launchers/common.sh"; mbc_new_run_id; mbc_new_run_id'
    ids = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert len(ids) == 2 and ids[0] != ids[1]
    assert all(i.startswith("run-") and len(i.split("-")) == 4 for i in ids)


def wait_until(condition, timeout, what, process=None):
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{what}: the launcher exited with {process.returncode}: {process.stdout.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def training_started(log_dir, ranks=(0, 1)):
    def check():
        try:
            return all(read_status(log_dir, r)["status"] == "training" and (read_status(log_dir, r)["step"] or 0) >= 1
                       for r in ranks)
        except (FileNotFoundError, json.JSONDecodeError):
            return False
    return check


@pytest.mark.slow
def test_a_rank_killed_with_sigkill_is_marked_failed_not_left_training(tmp_path):
    env = isolated_env(tmp_path, OMP_NUM_THREADS=1)
    run = subprocess.Popen(["bash", LAUNCHER, "--demo", "--num_epochs", "5000"], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_dir = tmp_path / "runs/demo/training_logs"
    try:
        wait_until(training_started(log_dir), 180, "both ranks training", run)
        os.kill(read_status(log_dir, 1)["pid"], signal.SIGKILL)
        output, _ = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    dead = read_status(log_dir, 1)
    assert dead["status"] == "failed" and dead["error"]["type"] == "RankDied", dead
    assert "rank 1" in dead["error"]["message"]
    assert read_status(log_dir, 0)["status"] not in ("starting", "loading", "training")


def test_node_0_refuses_a_master_port_another_program_listens_on(tmp_path):
    """Every node used to wait silently, with no status file, when node 0's rendezvous port was taken."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--multinode"],
                                cwd=tmp_path, env=isolated_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                                               NUM_MACHINES=2, MACHINE_RANK=0),
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"MASTER_PORT {port} is already in use on this machine" in result.stderr


def a_copy_of_the_launchers(tmp_path):
    """The launchers and presets in a project folder of their own (no .venv yet), the package on PYTHONPATH."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(REPO / "launchers", project / "launchers")
    shutil.copytree(REPO / "configs", project / "configs")
    return project


def without_the_venv(tmp_path, project_env_python=None):
    """An environment as a fresh login gives it: no venv active, no PYTHON, and on PATH only the system's python3
    (which lacks the project's packages) and the system's tools."""
    system_python = "/usr/bin/python3"
    probe = subprocess.run([system_python, "-c", "import rich, torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("the system python3 has rich and torch: it cannot stand for a python without the packages")
    shims = tmp_path / "system-bin"
    shims.mkdir()
    for name in ("python3", "python"):
        (shims / name).symlink_to(system_python)
    env = isolated_env(tmp_path, PATH=f"{shims}{os.pathsep}/usr/bin{os.pathsep}/bin", PYTHONPATH=str(REPO))
    for name in ("PYTHON", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def test_without_the_venv_the_launcher_says_in_one_line_how_to_activate_it_and_locks_nothing(tmp_path):
    """The launcher ran the system python: ModuleNotFoundError for rich, after it had taken the run's locks."""
    project = a_copy_of_the_launchers(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = without_the_venv(tmp_path)
    result = subprocess.run(["bash", str(project / "launchers" / "train_test.sh"), "--demo"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "python3 lacks" in lines[0] and "rich" in lines[0], lines[0]
    assert f"source {project}/.venv/bin/activate" in lines[0] and f"bash {project}/install.sh" in lines[0]
    assert list(work.iterdir()) == []   # no lock, no run record, no demo data
    stop = subprocess.run(["bash", str(project / "launchers" / "stop.sh"), "runs/demo/lora"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=60)
    assert stop.returncode == 2 and "source" in stop.stderr and "Traceback" not in stop.stderr, stop.stderr


@pytest.mark.slow
def test_without_the_venv_active_the_launcher_uses_the_projects_venv(tmp_path):
    import sys

    project = a_copy_of_the_launchers(tmp_path)
    venv_python = project / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')   # the environment the tests run in
    venv_python.chmod(0o755)
    result = subprocess.run(["bash", str(project / "launchers" / "train_test.sh"), "--demo", "--dry-run"],
                            cwd=tmp_path, env=without_the_venv(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{venv_python} -m accelerate.commands.launch" in result.stdout


def test_a_tracker_whose_package_is_missing_is_refused_at_start_naming_the_package(tmp_path):
    """--report_to wandb without wandb trained on silently (accelerate's one warning in the log)."""
    import importlib.util
    import sys

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    result = launcher(tmp_path, "--demo", "--dry-run", "--report_to", "wandb")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--report_to wandb" in result.stderr and "pip install wandb" in result.stderr, result.stderr
    assert "would run" not in result.stdout and not (tmp_path / "runs").exists()
    # The training refuses on its own too (started without the launcher), before any process group or model.
    train = subprocess.run([sys.executable, "-m", "diffsynth_mbc.train", "--config", DEMO_PRESET,
                            "--report_to", "wandb"], cwd=tmp_path, env=isolated_env(tmp_path), capture_output=True,
                           text=True, timeout=120)
    assert train.returncode == 2 and "pip install wandb" in train.stderr, train.stderr[-2000:]


def test_another_runs_folders_are_refused_before_anything_starts_dry_run_or_not(tmp_path):
    """The refusal came from the ranks, followed by ~45 lines of torch's ChildFailedError: off an 80x24 screen.
    Now the launcher's path check says it, as the last line, before accelerate starts; --dry_run finds it too."""
    from diffsynth_mbc.training.checkpoints.folder import temp_path
    from diffsynth_mbc.training.checkpoints.state import publish

    folder = temp_path(tmp_path / "runs" / "demo" / "lora" / "checkpoints", 4, "run-old")
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x")
    publish(folder, {"step": 4, "epoch": 0, "batches_in_epoch": 0, "run_id": "run-old"})
    for args in (("--dry_run",), ()):
        result = launcher(tmp_path, "--demo", "--skip_doctor", *args)
        assert result.returncode == 2, result.stdout + result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: the run's folders hold 1 checkpoint(s) or LoRA file(s) of run-old"), last
        assert "--start_over true" in last and "--log_dir is now runs/demo/training_logs" in last
        assert "accelerate" not in result.stderr and not (tmp_path / "runs" / "demo" / "training_logs").exists()
