"""What rank 0 prints while it trains, so the launcher's terminal and log file never look frozen.

Without a terminal (the launchers, which also write the log file; ``--detach``; CI): one plain line every
``print_every_s`` seconds and at every epoch end, then one summary when the run ends. When rank 0's
stderr is a terminal (``accelerate launch`` by hand), or the launcher says its own output is one
(``launcher_streams``): a rich progress bar there, with events as lines above it. The lines are made
from the status file's fields (pure formatting, no torch).
"""

from __future__ import annotations

import sys
import time

from diffsynth_mbc.run_files import overheads_text


def clock(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def progress_line(state: dict, overheads: bool = True) -> str:
    """``step 6/12 (50.0%) | epoch 1/2 | loss 0.1234 (avg 0.1300) | lr 1.00e-04 | 0.52 s/step | ...``

    s/step is the steps' own time; with ``overheads``, what the run spent between them ends the line
    (``checkpoints 3 x 4.6 s, validation 2 x 1.2 s``), once there was any."""
    step, total = state.get("step") or 0, state.get("total_steps") or 0
    percent = 100.0 * step / total if total else 0.0
    epoch, epochs = (state.get("epoch") or 0) + 1, state.get("num_epochs") or 1
    parts = [f"step {step}/{total} ({percent:.1f}%)", f"epoch {min(epoch, epochs)}/{epochs}",
             f"loss {_number(state.get('loss'), '.4f')} (avg {_number(state.get('loss_avg'), '.4f')})",
             f"lr {_number(state.get('lr'), '.2e')}", f"{_number(state.get('step_time_s'), '.2f')} s/step",
             f"{_number(state.get('samples_per_s'), '.2f')} samples/s", f"elapsed {clock(state.get('elapsed_s'))}",
             f"ETA {clock(state.get('eta_s'))}"]
    between = overheads_text(state.get("overheads")) if overheads else ""
    return " | ".join(parts + ([between] if between else []))


def summary_lines(state: dict, *, output_path: str, log_dir: str, best_val_loss: float | None) -> list[str]:
    lines = [f"{state.get('status')}: {state.get('step')}/{state.get('total_steps')} steps in "
             f"{clock(state.get('elapsed_s'))} (run {state.get('run_id')})"]
    if state.get("val_loss") is not None:
        lines.append(f"  validation loss: last {state['val_loss']:.4f} at step {state.get('val_step')}, "
                     f"best {best_val_loss:.4f}")
    lines.append(f"  LoRA: {output_path}/lora.safetensors")
    if state.get("last_checkpoint"):
        lines.append(f"  last checkpoint: {state['last_checkpoint']}")
    between = overheads_text(state.get("overheads"))
    if state.get("step_time_avg_s") is not None or between:
        lines.append(f"  time: {_number(state.get('step_time_avg_s'), '.2f')} s/step (the steps alone)"
                     + (f"; between steps: {between}" if between else ""))
    lines.append(f"  watch or inspect: python -m diffsynth_mbc.monitor {log_dir}")
    return lines


class TerminalProgress:
    """Rank 0's progress output; every other rank stays quiet (``enabled`` False).

    ``stream`` gets the plain lines (stderr, or the launcher's log file); ``bar_stream``, when given, is
    a terminal for the live bar (the launcher's, whose own output goes through ``tee``). Without
    ``bar_stream`` the bar is drawn on ``stream`` when that is a terminal, and replaces the lines there.
    """

    def __init__(self, enabled: bool, print_every_s: float = 30.0, stream=None, monotonic=time.monotonic,
                 bar_stream=None):
        self.enabled = enabled
        self.print_every_s = print_every_s
        self.stream = stream or sys.stderr
        self._monotonic = monotonic
        self._last_line = monotonic()
        self.best_val_loss = None
        self._bar = None
        if enabled and bar_stream is None and self.stream.isatty():
            bar_stream = self.stream
        self._lines_beside_bar = bar_stream is not None and bar_stream is not self.stream
        if enabled and bar_stream is not None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[line]}"), console=Console(file=bar_stream))
            self._task = self._bar.add_task("training", total=None, line="")
            self._bar.start()

    def step(self, state: dict) -> None:
        if not self.enabled:
            return
        if state.get("val_loss") is not None:
            self.best_val_loss = min(self.best_val_loss or state["val_loss"], state["val_loss"])
        if self._bar is not None:
            self._bar.update(self._task, total=state.get("total_steps"), completed=state.get("step") or 0,
                             line=progress_line(state, overheads=False).split(" | ", 2)[-1])
        if (self._bar is None or self._lines_beside_bar) and self._monotonic() - self._last_line >= self.print_every_s:
            self._last_line = self._monotonic()
            self._write_line(progress_line(state))

    def event(self, text: str) -> None:
        """A line above the bar (or in the log): an epoch end, a validation, a checkpoint."""
        if self.enabled:
            self._print(text)

    def finish(self, state: dict, *, output_path: str, log_dir: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
        for line in summary_lines(state, output_path=output_path, log_dir=log_dir, best_val_loss=self.best_val_loss):
            self._print(line)
        self._bar = None

    def _print(self, text: str) -> None:
        self._last_line = self._monotonic()
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
            if not self._lines_beside_bar:
                return
        self._write_line(text)

    def _write_line(self, text: str) -> None:
        try:
            print(text, file=self.stream, flush=True)
        except (OSError, ValueError):  # a full disk or closed log never stops training
            pass


def launcher_streams(environ) -> tuple[object | None, object | None]:
    """(line stream, bar stream) asked for by a launcher running in a terminal, else (None, None).

    The launcher tees every rank's output into its log file, so rank 0's stderr is a pipe. When the
    launcher's own output is a terminal it sets ``MBC_PROGRESS_TTY`` (that terminal) and
    ``MBC_PROGRESS_LOG`` (its log file): the live bar goes to the terminal and the plain lines to the
    log, so the terminal shows the bar and the log never looks frozen.
    """
    tty_path, log_path = environ.get("MBC_PROGRESS_TTY"), environ.get("MBC_PROGRESS_LOG")
    if not tty_path or not log_path:
        return None, None
    try:
        bar = open(tty_path, "w", buffering=1, encoding="utf-8")
    except OSError:
        return None, None
    if not bar.isatty():
        bar.close()
        return None, None
    try:
        lines = open(log_path, "a", buffering=1, encoding="utf-8")
    except OSError:
        bar.close()
        return None, None
    return lines, bar
