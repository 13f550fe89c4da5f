"""The DDP-aware step/ETA callback: a DiffSynth ``ModelLogger`` that also keeps per-rank metrics.

It has ModelLogger's shape (``on_step_end(accelerator, model, save_steps)``, ``on_epoch_end``,
``on_training_end``) so it can be handed to DiffSynth's own ``launch_training_task``; there it counts
optimizer steps from ``accelerator.sync_gradients`` (DiffSynth calls it once per micro-batch) and has
no loss to report. Our recipe (``diffsynth_mbc.training.recipe``) passes the loss, learning rate and sample count
as keyword arguments, and wraps what it does between steps (checkpoints, LoRA files, validation, samples) in
``overhead(kind)``, so step times and the ETA stay honest (``training.step_timing``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from diffsynth.trainers.utils import ModelLogger

from diffsynth_mbc import run_files
from diffsynth_mbc.gpu import GpuReader
from diffsynth_mbc.training.reporting.catalogue_progress import CatalogueProgress
from diffsynth_mbc.training.reporting.eta import OverheadSchedule
from diffsynth_mbc.training.reporting.run_summary import validation_event
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter
from diffsynth_mbc.training.reporting.step_timing import StepTiming
from diffsynth_mbc.training.reporting.terminal import TerminalProgress, progress_line


@dataclass
class Section:
    """An overhead section as the loop sees it; ``seconds`` is set when it ends."""
    kind: str
    seconds: float | None = None


class ProgressLogger(ModelLogger):
    def __init__(self, output_path: str, status: RankStatusWriter, *, steps_per_epoch: int, num_epochs: int,
                 samples_per_step: int, remove_prefix_in_ckpt: str | None = "pipe.dit.",
                 start_step: int = 0, rate_window: int = 50, warmup_steps: int = 2,
                 loss_average_window: int = 50, monotonic=time.monotonic, wall_clock=time.time,
                 printer: TerminalProgress | None = None, overhead_schedule: OverheadSchedule | None = None):
        super().__init__(output_path, remove_prefix_in_ckpt=remove_prefix_in_ckpt)
        self.status = status
        self.printer = printer or TerminalProgress(enabled=False)
        self._printed_val_step = None
        self._stage_note_said = False   # --resolution_stages: the first low-resolution validation says the size
        self._summary_printed = False
        self.steps_per_epoch = steps_per_epoch
        self.num_epochs = num_epochs
        self.samples_per_step = samples_per_step
        self.step = start_step
        # the epoch of the last step done (at an epoch's end, the one that ended); a run that goes on begins its next
        self.epoch = (start_step - 1) // steps_per_epoch if steps_per_epoch and start_step else 0
        self.timing = StepTiming(self.total_steps, steps_per_epoch, overhead_schedule, rate_window=rate_window,
                                 warmup_steps=warmup_steps, monotonic=monotonic)
        self._recent_losses: list[float] = []
        self._loss_average_window = loss_average_window
        self._wall_clock = wall_clock
        self.catalogues: CatalogueProgress | None = None   # several catalogues: each one's samples this epoch
        # GPU name, utilisation and memory (with the allocator's peak since the previous write) in every write.
        self.status.gpu_reader = GpuReader()
        self.status.update(total_steps=self.total_steps, steps_per_epoch=steps_per_epoch, num_epochs=num_epochs,
                           step=start_step, epoch=self.epoch)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.num_epochs

    # -- hooks --------------------------------------------------------------------------------
    def on_train_begin(self, **kwargs) -> None:
        self.timing.start()
        self.status.set_status(run_files.STATUS_TRAINING, phase="training: first step")

    def on_epoch_begin(self, epoch: int, **kwargs) -> None:
        self.epoch = epoch
        if self.catalogues is not None:
            self.catalogues.reset()
        self.status.update(epoch=epoch, **self.catalogue_fields())

    def track_catalogues(self, options, plan, world_size: int) -> None:
        """Count each catalogue's samples this epoch when the run trains several (``catalogue_progress``)."""
        self.catalogues = CatalogueProgress.from_run(options, plan, world_size)

    def count_catalogues(self, batch: list[dict]) -> None:
        """A batch the loop trains, counted for its samples' catalogues (several catalogues only)."""
        if self.catalogues is not None:
            self.catalogues.count(batch)

    def catalogue_fields(self) -> dict:
        return {"catalogue_progress": self.catalogues.as_list()} if self.catalogues is not None else {}

    def on_step_end(self, accelerator=None, model=None, save_steps=None, loss=None, lr=None,
                    samples=None, **kwargs) -> None:
        super().on_step_end(accelerator, model, save_steps)
        if accelerator is not None and not getattr(accelerator, "sync_gradients", True):
            return  # a micro-batch inside gradient accumulation: not an optimizer step
        self.step += 1
        times = self.timing.step_done(self.step)
        samples = self.samples_per_step if samples is None else samples
        if loss is not None:
            self._recent_losses.append(float(loss))
            del self._recent_losses[:-self._loss_average_window]
        seconds_per_step = times.step_time_avg_s
        record = {"step": self.step, "epoch": self.epoch, "loss": _maybe_float(loss), "lr": _maybe_float(lr),
                  "step_time_s": round(times.step_time_s, 4), "samples": samples, "time": round(self._wall_clock(), 3)}
        extra = {key: _maybe_float(value) for key, value in kwargs.items() if key in ("grad_norm",)}
        tokens = kwargs.get("tokens")
        if tokens:
            record["tokens"] = int(tokens)
        draws = kwargs.get("timestep_draws")
        if draws:   # each sample's (timestep, loss, mode[, shape]): loss by timestep, by mode and by bucket
            record["timesteps"] = [round(draw[0], 2) for draw in draws]
            record["timestep_losses"] = [float(f"{draw[1]:.6g}") for draw in draws]
            record["modes"] = [draw[2] for draw in draws]
            if all(len(draw) > 3 and draw[3] for draw in draws):
                record["shapes"] = [list(draw[3]) for draw in draws]   # [frames, height, width] in pixels
        if kwargs.get("rows"):   # the metadata rows it trained (0-based), sample by sample
            record["rows"] = [int(row) for row in kwargs["rows"]]
        if kwargs.get("nonfinite"):
            record["nonfinite"] = True   # skipped: the loss or gradient norm was inf/NaN
        record.update(extra)
        self.status.append_history(record)
        self.status.update(
            status=run_files.STATUS_TRAINING, phase=f"training epoch {self.epoch + 1}/{self.num_epochs}",
            step=self.step, epoch=self.epoch, loss=record["loss"], lr=record["lr"],
            loss_avg=(sum(self._recent_losses) / len(self._recent_losses)) if self._recent_losses else None,
            samples_seen=(self.status.state.get("samples_seen") or 0) + samples,
            step_time_s=record["step_time_s"], step_time_avg_s=_rounded(seconds_per_step, 4),
            samples_per_s=(samples / seconds_per_step) if seconds_per_step else None,
            tokens_per_s=(tokens / seconds_per_step) if tokens and seconds_per_step else None,
            eta_s=times.eta_s, eta_overheads_s=round(times.eta_overheads_s, 3),
            progress=round(100.0 * self.step / self.total_steps, 3) if self.total_steps else 100.0,
            **extra, **self.catalogue_fields(),
        )
        self.printer.step(self.status.state)
        if accelerator is not None and getattr(accelerator, "trackers", None):
            scalars = {key: record.get(key) for key in ("loss", "lr", "grad_norm", "step_time_s")}
            scalars["samples_per_s"] = self.status.state.get("samples_per_s")
            accelerator.log({k: v for k, v in scalars.items() if v is not None}, step=self.step)

    @contextlib.contextmanager
    def overhead(self, kind: str):
        """``with logger.overhead("checkpoint"):`` around work between steps: timed apart from the steps, tallied,
        and one ``{"kind": "overhead"}`` line in the history. Yields a ``Section`` whose ``seconds`` is set after."""
        section = Section(kind)
        self.timing.clock.begin(kind)
        try:
            yield section
        except BaseException:
            self.timing.clock.end(tally=False)   # failed work is no measure of the next one
            raise
        _, section.seconds = self.timing.clock.end()
        self.status.append_history({"kind": run_files.OVERHEAD_RECORD, "overhead": kind, "step": self.step,
                                    "seconds": round(section.seconds, 3), "time": round(self._wall_clock(), 3)})
        self.status.update(overheads=self.timing.clock.as_dict())
        if kind == "checkpoint":
            self.printer.event(f"checkpoint at step {self.step} saved in {section.seconds:.1f} s")

    def timed(self, kind: str, work, *args, **kwargs):
        """``work(*args, **kwargs)`` as an overhead section of ``kind``; returns what it returns."""
        with self.overhead(kind):
            return work(*args, **kwargs)

    def on_validation(self, accelerator=None) -> None:
        state = self.status.state
        if state.get("val_step") is not None and state.get("val_step") != self._printed_val_step:
            self._printed_val_step = state["val_step"]
            if accelerator is not None and getattr(accelerator, "trackers", None):
                scalars = ("val_loss", "val_loss_base")
                accelerator.log({key: state[key] for key in scalars if state.get(key) is not None},
                                step=state["val_step"])
            self.printer.step(state)
            tally = self.timing.clock.tallies.get("validation")
            took = f" ({tally.last_s:.1f} s)" if tally and tally.last_s is not None else ""
            line = validation_event(state, took)   # with the base model's loss beside it
            stage = state.get("stage")
            if stage and not stage.get("final") and not self._stage_note_said:   # --resolution_stages, said once
                self._stage_note_said = True
                line += (f" (validation and sample clips stay at the final size in every stage; this step trains at "
                         f"stage {stage['stage']}'s {stage['size']})")
            self.printer.event(line)

    def print_summary(self) -> None:
        """The run's summary on rank 0's terminal, once (finished or stopped)."""
        if not self._summary_printed:
            self._summary_printed = True
            self.printer.finish(self.status.state, output_path=str(self.output_path),
                                log_dir=str(self.status.log_dir))

    def on_epoch_end(self, accelerator=None, model=None, epoch_id=None, **kwargs) -> None:
        # DiffSynth's loop saves an epoch file through the parent; ours saves its own output.
        if accelerator is not None and model is not None and kwargs.get("save_epoch_file", True):
            self.timed("lora", super().on_epoch_end, accelerator, model, epoch_id)
        self.status.flush()
        self.printer.event(f"epoch {self.epoch + 1}/{self.num_epochs} done | {progress_line(self.status.state)}")

    def on_training_end(self, accelerator=None, model=None, save_steps=None, **kwargs) -> None:
        if accelerator is not None and model is not None:
            self.timed("lora", super().on_training_end, accelerator, model, save_steps)
        self.status.set_status(run_files.STATUS_FINISHED, phase="finished", eta_s=0.0, eta_overheads_s=0.0,
                               progress=100.0 if self.step >= self.total_steps else self.status.state["progress"])
        self.print_summary()


def _rounded(value, digits: int):
    return None if value is None else round(value, digits)


def _maybe_float(value):
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
