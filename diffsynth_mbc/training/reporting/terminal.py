"""What rank 0 prints while it trains, so the launcher's terminal and log file never look frozen.

Without a terminal (the launchers, which also write the log file; ``--detach``; CI): one plain line every
``print_every_s`` seconds and at every epoch end, then one summary when the run ends. When rank 0's
stderr is a terminal (``accelerate launch`` by hand), or the launcher says its own output is one
(``launcher_streams``): a rich progress bar there, with events as lines above it. The lines are made
from the status file's fields (pure formatting, no torch).

The bar fits the terminal it is drawn on (measured on that terminal, not on rank 0's own streams, which
the launcher pipes): step/total, % and ETA come first and always show, then the bar, then loss,
elapsed, s/step, samples/s, epoch and lr as the width allows, each whole or not at all.
"""

from __future__ import annotations

import os
import sys
import time

from diffsynth_mbc import environment
from diffsynth_mbc.run_files import STOPPED_STATUSES, overheads_text
from diffsynth_mbc.run_layout import FINAL_LORA
from diffsynth_mbc.training.reporting.catalogue_progress import catalogues_text
from diffsynth_mbc.training.reporting.run_summary import files_lines, replaced_lines, validation_lines


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
    seen = catalogues_text(state.get("catalogue_progress"))   # several catalogues: each one's samples this epoch
    between = overheads_text(state.get("overheads")) if overheads else ""
    return " | ".join(parts + ([f"seen: {seen}"] if seen else []) + ([between] if between else []))


BAR_MIN, BAR_MAX = 10, 40   # the bar's own width, in columns
BAR_SEPARATOR = " | "


def bar_head(state: dict) -> str:
    """What the live bar always shows: ``step 6/12 (50.0%) ETA 0:01:01``."""
    step, total = state.get("step") or 0, state.get("total_steps") or 0
    percent = 100.0 * step / total if total else 0.0
    return f"step {step}/{total} ({percent:.1f}%) ETA {clock(state.get('eta_s'))}"


def bar_extras(state: dict) -> list[str]:
    """The bar's other fields, most wanted first."""
    epoch, epochs = (state.get("epoch") or 0) + 1, state.get("num_epochs") or 1
    return [f"loss {_number(state.get('loss'), '.4f')} (avg {_number(state.get('loss_avg'), '.4f')})",
            f"elapsed {clock(state.get('elapsed_s'))}", f"{_number(state.get('step_time_s'), '.2f')} s/step",
            f"{_number(state.get('samples_per_s'), '.2f')} samples/s", f"epoch {min(epoch, epochs)}/{epochs}",
            f"lr {_number(state.get('lr'), '.2e')}"]


def bar_layout(state: dict, width: int) -> tuple[str, int, list[str]]:
    """(head, bar columns (0: none), extra fields) for a line of ``width`` columns.

    The head always; the extras in order while each fits whole beside a bar of at least BAR_MIN columns (the
    first one that does not fit ends them, so what shows is always the most wanted); the bar takes what is
    left, up to BAR_MAX, when BAR_MIN fits."""
    head = bar_head(state)
    room = width - len(head)
    extras, used = [], 0
    for field in bar_extras(state):
        if used + len(BAR_SEPARATOR) + len(field) + 1 + BAR_MIN > room:
            break
        extras.append(field)
        used += len(BAR_SEPARATOR) + len(field)
    left = room - used - 1
    return head, (min(BAR_MAX, left) if left >= BAR_MIN else 0), extras


class BarView:
    """The live bar's one line, laid out for the width rich renders it at."""

    def __init__(self, state: dict | None = None):
        self.state = state or {}

    def __rich_console__(self, console, options):
        from rich.text import Text

        head, columns, extras = bar_layout(self.state, options.max_width)
        line = Text(head, style="bold")
        if columns:
            total = self.state.get("total_steps") or 0
            done = round(columns * min(1.0, (self.state.get("step") or 0) / total)) if total else 0
            line.append(" ")
            line.append("━" * done, style="bar.complete" if done < columns else "bar.finished")
            line.append("━" * (columns - done), style="bar.back")
        for field in extras:
            line.append(BAR_SEPARATOR + field)
        line.no_wrap, line.overflow = True, "crop"
        yield line


def summary_lines(state: dict, *, output_path: str, log_dir: str, best_val_loss: float | None) -> list[str]:
    lines = [f"{state.get('status')}: {state.get('step')}/{state.get('total_steps')} steps in "
             f"{clock(state.get('elapsed_s'))} (run {state.get('run_id')})"]
    if state.get("val_loss") is not None:
        lines.append(f"  validation loss: last {state['val_loss']:.4f} at step {state.get('val_step')}, "
                     f"best {best_val_loss:.4f}")
    lines += validation_lines(state)   # against the base model, once it was measured
    lines += replaced_lines(state)     # bad media files replaced by other rows, over every rank
    if state.get("status") in STOPPED_STATUSES:   # no LoRA file yet: the checkpoint is what the run left
        if state.get("last_checkpoint"):
            lines.append(f"  resume from: {state['last_checkpoint']} (--resume latest)")
        lines += files_lines(output_path, state.get("run_id"))
    else:
        lines.append(f"  LoRA: {output_path}/{FINAL_LORA}")
        from diffsynth_mbc.training.lora.export import dora_run_note   # a DoRA: DiffSynth's loader ignores dora_scale

        note = dora_run_note(f"{output_path}/{FINAL_LORA}")
        lines += [f"  {note}"] if note else []
        lines += files_lines(output_path, state.get("run_id"))   # lora_ema, epoch and step files of this run
        if state.get("last_checkpoint"):
            lines.append(f"  last checkpoint: {state['last_checkpoint']}")
    between = overheads_text(state.get("overheads"))
    if state.get("step_time_avg_s") is not None or between:
        rate = state.get("samples_per_s")
        lines.append(f"  time: {_number(state.get('step_time_avg_s'), '.2f')} s/step (the steps alone)"
                     + (f", {rate:.2f} samples/s per GPU" if rate is not None else "")
                     + (f"; between steps: {between}" if between else ""))
    lines.append(f"  watch or inspect: python -m diffsynth_mbc.monitor {log_dir}")
    from diffsynth_mbc.training.components.best_lora import summary_lines as best_lora_lines

    lines += best_lora_lines(state)   # the best LoRA, and why an early stop ended the run
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
            from rich.live import Live

            # rank 0's own streams are pipes under the launcher: rich would take 80 columns; the bar's terminal says
            self._bar_stream, self._view = bar_stream, BarView()
            self._bar = Live(self._view, console=Console(file=bar_stream, width=_terminal_width(bar_stream)),
                             auto_refresh=False, transient=False, redirect_stdout=False, redirect_stderr=False)
            self._bar.start()

    def step(self, state: dict) -> None:
        if not self.enabled:
            return
        if state.get("val_loss") is not None:
            self.best_val_loss = min(self.best_val_loss or state["val_loss"], state["val_loss"])
        if self._bar is not None:
            self._view.state = dict(state)
            width = _terminal_width(self._bar_stream)
            if width is not None:   # the terminal may have been resized since
                self._bar.console.width = width
            self._bar.refresh()
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


def _terminal_width(stream) -> int | None:
    """Columns of the terminal ``stream`` writes to, or None (not a terminal: rich decides)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (AttributeError, ValueError, OSError):
        return None


def launcher_streams(environ) -> tuple[object | None, object | None]:
    """(line stream, bar stream) asked for by a launcher running in a terminal, else (None, None).

    The launcher tees every rank's output into its log file, so rank 0's stderr is a pipe. When the
    launcher's own output is a terminal it sets ``MBC_PROGRESS_TTY`` (that terminal) and
    ``MBC_PROGRESS_LOG`` (its log file): the live bar goes to the terminal and the plain lines to the
    log, so the terminal shows the bar and the log never looks frozen.
    """
    tty_path, log_path = environ.get(environment.PROGRESS_TTY), environ.get(environment.PROGRESS_LOG)
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
