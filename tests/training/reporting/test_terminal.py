"""Rank 0's terminal output: periodic progress lines without a terminal, epoch and validation events, a summary."""

import io

from diffsynth_mbc.training.reporting.terminal import TerminalProgress, clock, progress_line, summary_lines

STATE = {"step": 6, "total_steps": 12, "epoch": 0, "num_epochs": 2, "loss": 0.1234, "loss_avg": 0.13, "lr": 1e-4,
         "step_time_s": 0.52, "samples_per_s": 3.8, "elapsed_s": 3725, "eta_s": 61, "status": "training",
         "run_id": "run-x"}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_progress_line_has_every_field_whole():
    line = progress_line(STATE)
    assert line == ("step 6/12 (50.0%) | epoch 1/2 | loss 0.1234 (avg 0.1300) | lr 1.00e-04 | 0.52 s/step | "
                    "3.80 samples/s | elapsed 1:02:05 | ETA 0:01:01")
    assert progress_line({"step": 0, "total_steps": 0}).startswith("step 0/0 (0.0%)")
    assert clock(None) == "-" and clock(59.6) == "0:01:00"


def test_lines_every_interval_not_every_step_and_only_on_rank_0():
    stream, now = io.StringIO(), Clock()
    printer = TerminalProgress(enabled=True, print_every_s=30, stream=stream, monotonic=now)
    for step in range(1, 101):
        now.now += 1.0
        printer.step({**STATE, "step": step})
    lines = stream.getvalue().splitlines()
    assert [line.split(" ")[1] for line in lines] == ["30/12", "60/12", "90/12"]
    quiet = io.StringIO()
    TerminalProgress(enabled=False, stream=quiet).step(STATE)
    assert quiet.getvalue() == ""


def test_the_summary_says_where_everything_is():
    state = {**STATE, "status": "finished", "step": 12, "val_loss": 0.2, "val_step": 12,
             "last_checkpoint": "runs/x/lora/checkpoints/step-00000012"}
    lines = summary_lines(state, output_path="runs/x/lora", log_dir="runs/x/lora/training_logs", best_val_loss=0.15)
    assert lines[0] == "finished: 12/12 steps in 1:02:05 (run run-x)"
    assert "best 0.1500" in lines[1] and "runs/x/lora/lora.safetensors" in lines[2]
    assert lines[-1] == "  watch or inspect: python -m diffsynth_mbc.monitor runs/x/lora/training_logs"


def test_with_a_bar_on_the_launchers_terminal_the_lines_still_reach_the_log():
    log, terminal, now = io.StringIO(), io.StringIO(), Clock()
    printer = TerminalProgress(enabled=True, print_every_s=30, stream=log, monotonic=now, bar_stream=terminal)
    for step in range(1, 61):
        now.now += 1.0
        printer.step({**STATE, "step": step})
    printer.event("validation at step 60: val_loss 0.2000")
    printer.finish({**STATE, "step": 60, "status": "finished"}, output_path="out", log_dir="logs")
    lines = log.getvalue().splitlines()
    assert [line.split(" ")[1] for line in lines[:2]] == ["30/12", "60/12"]
    assert lines[2] == "validation at step 60: val_loss 0.2000" and lines[3].startswith("finished: 60/12 steps")
    shown = terminal.getvalue()  # the bar's console: the event and the summary too, never the periodic lines
    assert "validation at step 60" in shown and "finished: 60/12 steps" in shown and "step 30/12" not in shown


def test_launcher_streams_only_when_asked_for_and_the_terminal_is_real(tmp_path):
    from diffsynth_mbc.training.reporting.terminal import launcher_streams
    log = tmp_path / "train.log"
    assert launcher_streams({}) == (None, None)
    assert launcher_streams({"MBC_PROGRESS_TTY": str(tmp_path / "not-a-tty"), "MBC_PROGRESS_LOG": str(log)}) \
        == (None, None)  # a regular file is not a terminal: plain lines on stderr as before
    assert launcher_streams({"MBC_PROGRESS_TTY": "/nonexistent/tty", "MBC_PROGRESS_LOG": str(log)}) == (None, None)


OVERHEADS = {"checkpoint": {"count": 3, "total_s": 13.8, "last_s": 4.5, "mean_s": 4.6},
             "validation": {"count": 2, "total_s": 2.4, "last_s": 1.3, "mean_s": 1.2}}


def test_overheads_are_shown_apart_from_the_step_time():
    line = progress_line({**STATE, "overheads": OVERHEADS})
    assert line.endswith("| 0.52 s/step | 3.80 samples/s | elapsed 1:02:05 | ETA 0:01:01 | "
                         "checkpoints 3 x 4.6 s, validation 2 x 1.2 s")
    assert progress_line({**STATE, "overheads": OVERHEADS}, overheads=False) == progress_line(STATE)
    state = {**STATE, "status": "finished", "step": 12, "step_time_avg_s": 0.5, "overheads": OVERHEADS}
    lines = summary_lines(state, output_path="out", log_dir="logs", best_val_loss=None)
    assert ("  time: 0.50 s/step (the steps alone), 3.80 samples/s per GPU; between steps: checkpoints 3 x 4.6 s, "
            "validation 2 x 1.2 s") in lines


def test_the_summary_of_a_finished_run_says_its_throughput():
    """It used to give s/step alone; the monitor showed samples/s "-" for the same finished run."""
    state = {**STATE, "status": "finished", "step": 12, "step_time_avg_s": 0.5}
    lines = summary_lines(state, output_path="out", log_dir="logs", best_val_loss=None)
    assert "  time: 0.50 s/step (the steps alone), 3.80 samples/s per GPU" in lines
    lines = summary_lines({**state, "samples_per_s": None}, output_path="out", log_dir="logs", best_val_loss=None)
    assert "  time: 0.50 s/step (the steps alone)" in lines


def bar_as_drawn(state: dict, width: int) -> str:
    from rich.console import Console

    from diffsynth_mbc.training.reporting.terminal import BarView

    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(BarView(state))
    return out.getvalue()


def test_at_80_columns_the_bar_keeps_step_total_percent_and_eta_first():
    """A narrow terminal used to show "tra… loss 0.3090 … el…": the step count and ETA went first."""
    state = {**STATE, "step": 1234, "total_steps": 85090, "eta_s": 9 * 86400 + 61, "elapsed_s": 3 * 86400,
             "overheads": OVERHEADS}
    drawn = bar_as_drawn(state, 80)
    assert drawn.count("\n") == 1 and len(drawn.rstrip("\n")) <= 80, drawn
    assert drawn.startswith("step 1234/85090 (1.5%) ETA 216:01:01 ━"), drawn
    assert "…" not in drawn and "checkpoints" not in drawn
    for field in ("loss", "elapsed", "s/step", "samples/s", "lr"):   # what comes after: whole or not at all
        assert field not in drawn or f"{field} " in drawn or f" {field}" in drawn, drawn
    assert "loss 0.1234 (avg 0.1300)" in bar_as_drawn(STATE, 80)
    assert bar_as_drawn(STATE, 40).startswith("step 6/12 (50.0%) ETA 0:01:01")   # even where nothing else fits


def test_at_200_columns_the_bar_shows_every_field():
    drawn = bar_as_drawn({**STATE, "overheads": OVERHEADS}, 200)
    assert drawn.startswith("step 6/12 (50.0%) ETA 0:01:01 " + "━" * 40 + " | loss 0.1234 (avg 0.1300)"), drawn
    for field in ("elapsed 1:02:05", "0.52 s/step", "3.80 samples/s", "epoch 1/2", "lr 1.00e-04"):
        assert field in drawn, field
    assert "checkpoints" not in drawn       # the overheads stay in the log lines and the summary


def test_the_live_bar_is_drawn_on_its_terminal_stream():
    terminal, now = io.StringIO(), Clock()
    printer = TerminalProgress(enabled=True, print_every_s=30, stream=io.StringIO(), monotonic=now,
                               bar_stream=terminal)
    printer.step({**STATE, "overheads": OVERHEADS})
    printer.finish({**STATE, "status": "finished"}, output_path="out", log_dir="logs")
    shown = terminal.getvalue()   # not a terminal: rich draws the bar's last state once, when it stops
    assert shown.index("step 6/12 (50.0%) ETA 0:01:01") < shown.index("finished: 6/12 steps")


def test_the_summary_counts_and_names_the_media_replaced_on_every_rank():
    """3 samples were replaced during a run (``skipped_samples`` in the status files) and the summary said nothing."""
    from diffsynth_mbc.training.reporting.run_summary import replaced_media

    ranks = [(120, 2, {"9": ["media/photo.png", 2]}), (124, 1, {"9": ["media/photo.png", 1]})]
    state = {**STATE, "status": "finished", "step": 12, "replaced_media": replaced_media(ranks)}
    lines = summary_lines(state, output_path="out", log_dir="logs", best_val_loss=None)
    assert ("  replaced as bad media: 3 of 244 samples (1.2%), from 1 row: row 9 (media/photo.png) 3 times (the last "
            "reasons: skip_reasons in each rank's status file)") in lines
    many = [(500, 7, {str(row): [f"media/{row}.mp4", 1] for row in (30, 2, 11, 4, 7, 5, 6)})]
    line = next(line for line in summary_lines({**state, "replaced_media": replaced_media(many)}, output_path="out",
                                               log_dir="logs", best_val_loss=None) if "replaced" in line)
    assert "from 7 rows: row 2 (media/2.mp4) 1 time, row 4 (media/4.mp4) 1 time, row 5" in line
    assert "row 7 (media/7.mp4) 1 time and 2 more" in line
    nothing = replaced_media([(120, 0, {}), (124, 0, {})])
    assert not [line for line in summary_lines({**state, "replaced_media": nothing}, output_path="out",
                                               log_dir="logs", best_val_loss=None) if "replaced" in line]
