import json

import pytest

from diffsynth_mbc import run_files
from diffsynth_mbc.run_files import rank_from_environment
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter


class FakeClock:
    """Only the clock is simulated; files are real."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def read(path):
    return json.loads(path.read_text())


def test_file_exists_from_the_first_instant_with_every_field(tmp_path):
    writer = RankStatusWriter(tmp_path, "run-1", rank=3, local_rank=1, world_size=4)
    state = read(run_files.status_path(tmp_path, 3))
    assert state["status"] == "starting" and state["rank"] == 3 and state["local_rank"] == 1
    assert set(run_files.STATUS_FIELDS) <= set(state)
    # These three once sat inside a comment of STATUS_FIELDS, so the starting file lacked them.
    assert {"total_steps", "steps_per_epoch", "samples_seen"} <= set(state)
    assert state["schema_version"] == run_files.SCHEMA_VERSION
    writer.close()


def test_ranks_write_distinct_files(tmp_path):
    for rank in range(2):
        RankStatusWriter(tmp_path, "run", rank=rank, local_rank=0, world_size=2).close()  # two nodes, local 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["training_gpu0.json", "training_gpu1.json"]


def test_writes_are_throttled_but_status_changes_are_immediate(tmp_path):
    clock = FakeClock()
    writer = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=5, monotonic=clock, wall_clock=clock)
    path = run_files.status_path(tmp_path, 0)
    writer.set_status("training", phase="training")
    clock.now += 1
    writer.update(step=1, loss=0.5)
    assert read(path)["step"] == 0          # within the interval: not rewritten
    clock.now += 5
    writer.update(step=2)
    assert read(path)["step"] == 2          # interval passed
    clock.now += 1
    writer.set_status("finished")
    assert read(path)["status"] == "finished"


def test_write_due_follows_the_throttle(tmp_path):
    clock = FakeClock()
    writer = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=5, monotonic=clock, wall_clock=clock)
    assert not writer.write_due()            # just written at start
    clock.now += 4.9
    assert not writer.write_due()
    clock.now += 0.2
    assert writer.write_due()
    writer.update(step=1)
    assert not writer.write_due()


def test_failure_records_message_and_traceback(tmp_path):
    writer = RankStatusWriter(tmp_path, "run", 0, 0, 1)
    try:
        raise RuntimeError("VAE encode exploded at row 97000")
    except RuntimeError as exc:
        writer.fail(exc)
    state = read(run_files.status_path(tmp_path, 0))
    assert state["status"] == "failed"
    assert state["error"]["message"] == "VAE encode exploded at row 97000"
    assert "RuntimeError" in state["error"]["traceback_tail"]


def test_history_is_appended_one_line_per_record_and_a_new_run_sets_the_old_one_aside(tmp_path):
    writer = RankStatusWriter(tmp_path, "run-a", 0, 0, 1)
    for step in (1, 2, 3):
        writer.append_history({"step": step})
    writer.close()
    lines = run_files.history_path(tmp_path, 0).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    RankStatusWriter(tmp_path, "run-b", 0, 0, 1).close()
    assert not run_files.history_path(tmp_path, 0).exists()
    assert len(list(tmp_path.glob("training_gpu0.*.jsonl.old"))) == 1


def test_rank_comes_from_the_launcher_environment():
    assert rank_from_environment({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}) == (5, 1, 8)
    assert rank_from_environment({}) == (0, 0, 1)


def test_an_unwritable_log_folder_never_stops_training_and_nothing_is_lost(tmp_path):
    """The log folder becomes unwritable mid-run (here: replaced by a file, which stops root too): writes fail,
    are counted and reported once, training goes on, and once it is writable again every line is there."""
    import io
    clock, report = FakeClock(), io.StringIO()
    log_dir = tmp_path / "logs"
    writer = RankStatusWriter(log_dir, "run", 0, 0, 1, min_interval_s=0, monotonic=clock, wall_clock=clock,
                              stream=report)
    writer.set_status("training")
    writer.append_history({"step": 1})
    log_dir.rename(tmp_path / "logs-away")
    log_dir.write_text("not a folder")
    for step in (2, 3, 4):
        clock.now += 1
        writer.update(step=step)                   # must not raise
        writer.append_history({"step": step})
    assert writer.write_failures >= 2
    assert report.getvalue().count("warning: cannot write rank 0's status file") == 1   # once per minute
    log_dir.unlink()
    (tmp_path / "logs-away").rename(log_dir)
    clock.now += 120                                # past the back-off
    writer.update(step=5)
    writer.append_history({"step": 5})
    writer.set_status("finished")
    writer.close()
    assert read(run_files.status_path(log_dir, 0))["status"] == "finished"
    assert read(run_files.status_path(log_dir, 0))["write_failures"] == writer.write_failures
    steps = [json.loads(line)["step"] for line in run_files.history_path(log_dir, 0).read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_history_lines_wait_in_order_while_the_history_cannot_be_opened(tmp_path):
    import io
    clock, report = FakeClock(), io.StringIO()
    log_dir = tmp_path / "logs"
    writer = RankStatusWriter(log_dir, "run", 0, 0, 1, min_interval_s=0, monotonic=clock, wall_clock=clock,
                              stream=report)
    log_dir.rename(tmp_path / "away")
    log_dir.write_text("not a folder")
    for step in (1, 2, 3):
        clock.now += 0.1
        writer.append_history({"step": step})
    assert "warning: cannot write rank 0's history file" in report.getvalue()
    log_dir.unlink()
    (tmp_path / "away").rename(log_dir)
    clock.now += 120
    writer.append_history({"step": 4})
    writer.close()
    steps = [json.loads(line)["step"] for line in run_files.history_path(log_dir, 0).read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert "written again" in report.getvalue()


def test_set_aside_histories_do_not_pile_up(tmp_path):
    """Each new run sets the previous history aside; 10 files after 5 runs of 2 ranks once piled up."""
    for run in range(6):
        writer = RankStatusWriter(tmp_path, f"run-{run}", 0, 0, 1, keep_old_histories=3)
        writer.append_history({"step": 1, "run": run})
        writer.close()
        old = sorted(tmp_path.glob("training_gpu0.*.jsonl.old"), key=lambda p: p.stat().st_mtime_ns)
        assert len(old) == min(run, 3)
    kept_runs = [json.loads(p.read_text())["run"] for p in old]
    assert kept_runs == [2, 3, 4]                  # the newest three previous runs
    assert json.loads(run_files.history_path(tmp_path, 0).read_text())["run"] == 5


def test_gpu_fields_are_read_right_before_each_write_and_only_then(tmp_path):
    """The allocator is asked (and its peak reset) once per write of the file, so each file shows the peak since
    the previous one; throttled updates ask nothing; the stop-signal thread never asks."""
    import threading

    clock = FakeClock()
    readings = []

    def reader():
        readings.append(clock.now)
        return {"name": "GPU", "peak_allocated_mb": len(readings)}

    writer = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=5, monotonic=clock, wall_clock=clock)
    path = run_files.status_path(tmp_path, 0)
    writer.gpu_reader = reader
    writer.set_status("training", phase="training")
    assert read(path)["gpu"] == {"name": "GPU", "peak_allocated_mb": 1}
    clock.now += 1
    writer.update(step=1)                    # throttled: no write, no reading
    assert len(readings) == 1
    clock.now += 5
    writer.update(step=2)
    assert read(path)["gpu"]["peak_allocated_mb"] == 2 and len(readings) == 2
    other = threading.Thread(target=lambda: writer.set_status("stopped", phase="stopped by signal 15"))
    other.start()
    other.join()
    assert read(path)["status"] == "stopped" and read(path)["gpu"]["peak_allocated_mb"] == 2
    assert len(readings) == 2
    writer.close()


def test_a_rank_waiting_in_a_collective_keeps_its_file_fresh_and_says_for_what(tmp_path):
    """While the main thread is blocked (here: sleeping inside the wait), a heartbeat thread rewrites the file;
    once the wait ends, the file says at once that it no longer waits."""
    import time

    writer = RankStatusWriter(tmp_path, "run", 0, 0, 2, min_interval_s=0.2)
    path = run_files.status_path(tmp_path, 0)
    writer.set_status("training", phase="training epoch 1/1")
    entered = time.time()
    with writer.waiting("ranks in all-reduce (step agreement)"):
        time.sleep(2.0)                                  # no update() from the main thread meanwhile
        during = read(path)
    assert during["waiting"]["for"] == "ranks in all-reduce (step agreement)"
    assert during["waiting"]["since"] == pytest.approx(entered, abs=1.0)
    assert during["updated_at"] >= entered + 0.5         # kept fresh by the heartbeat, not by the main thread
    assert read(path)["waiting"] is None
    with writer.waiting("ranks in all-reduce (step agreement)"):
        pass                                             # a wait of the usual length writes nothing
    assert read(path)["waiting"] is None
    writer.close()


def test_a_field_the_schema_does_not_declare_is_refused_naming_it(tmp_path):
    """#61 item 5: a status field is one the schema declares, with its type, for that kind of file; anything else is
    a programming error raised at once, and the state and the file stay as they were."""
    clock = FakeClock()
    writer = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=0, monotonic=clock, wall_clock=clock)
    writer.update(step=3, loss=0.5, val_loss=0.25)                   # declared, of their types
    before = read(run_files.status_path(tmp_path, 0))
    for fields, named in (({"step": 4, "val_los": 0.2}, "'val_los' is not declared"),
                          ({"loss": "0.4"}, "'loss' is a number, not str"),
                          ({"step": 4.0}, "'step' is a whole number, not float"),
                          ({"new_best": 1}, "'new_best' is true or false, not int"),
                          ({"best": [4, 0.2]}, "'best' is an object, not list"),
                          ({"rows_done": 12}, "'rows_done' is not one of a training rank's")):
        with pytest.raises(run_files.StatusFieldError, match=named):
            writer.update(**fields)
        with pytest.raises(run_files.StatusFieldError, match=named):
            writer.set_status("training", **fields)
    assert writer.state["step"] == 3 and "val_los" not in writer.state and writer.state["status"] == "starting"
    clock.now += 1
    writer.flush()
    assert {k: v for k, v in read(run_files.status_path(tmp_path, 0)).items() if k != "updated_at"} == \
        {k: v for k, v in before.items() if k != "updated_at"} | {"elapsed_s": 1.0}
    writer.close()


def test_a_cache_ranks_writer_takes_the_cache_fields_and_refuses_the_trainings(tmp_path):
    writer = RankStatusWriter(tmp_path, "run", 0, 0, 1, kind=run_files.CACHE)
    writer.update(rows_done=3, rows_total=9, step=3, total_steps=9, progress=33.3)
    with pytest.raises(run_files.StatusFieldError, match="'loss' is not one of a cache rank's"):
        writer.update(loss=0.5)
    writer.flush()
    state = read(run_files.status_path(tmp_path, 0))
    assert state["rows_done"] == 3 and "loss" not in state and "best" not in state   # a cache rank's fields only
    assert set(run_files.fields_in_every_file(run_files.CACHE)) <= set(state)
    writer.close()


def test_every_field_a_status_update_names_in_the_package_is_declared():
    """Every keyword of a ``status.update(...)`` / ``set_status(...)`` call in the package's code is a declared field
    of the files that writer writes (the fields built in dicts are checked when written, in every run's test)."""
    import ast
    from pathlib import Path

    package = Path(run_files.__file__).parent
    named = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("update", "set_status") and \
                    ast.unparse(node.func.value).endswith(("status", "writer")):
                for keyword in node.keywords:
                    if keyword.arg:
                        named.setdefault(keyword.arg, set()).add(f"{path.relative_to(package)}:{node.lineno}")
    assert len(named) > 50   # the calls are found
    assert {name: sorted(where) for name, where in named.items() if name not in run_files.STATUS_SCHEMA} == {}
