"""What a per-step feature is to the training recipe (``training/recipe.py``): a component that owns its state and
answers a few hooks, and the typed decision it returns. Pure: no torch.

The recipe builds the components once, after the run's parts (``Parts``), in one documented order, and calls their
hooks in that order on every rank alike:

- ``votes(result)``: integers this rank contributes to the one all-reduce of every step (summed over the ranks and
  handed back to every component as ``StepContext.agreed``): a stop request, a checkpoint time, bad media;
- ``at_start(context)``: once, before the first step of this process (a fresh run's or a resume's);
- ``on_gradients(step, grad_norm, max_norm)``: at the end of a step's backward, after clipping, before the
  optimizer step (the gradients are still there); ``grad_norm`` is a 0-dim tensor on the device (or None): reading
  it waits for the GPU, so a component reads it only on the steps it needs it;
- ``after_step(context) -> Decision``: after every optimizer step;
- ``after_validation(context) -> Decision``: after a validation was measured, before its record is written (a
  component may add to ``context.validation``);
- ``after_training(context)``: once, when the steps end (at the total, an early stop or a stop request), before the
  end's work;
- ``at_end(context)``: once, when the run ends at its total or an early stop (after the last validation);
- ``failure_note(error)``: what it adds to the message of a run failing with a broken LoRA (non-finite steps, a
  LoRA that is not finite at the end), or None;
- ``state_dict()`` / ``load_state_dict(state)``: what a checkpoint keeps of it, under its ``name``
  (``per_rank``: each rank's own, saved for every rank), JSON only; ``save_files(folder)`` / ``load_files(folder,
  step)`` for tensors (rank 0 writes into the checkpoint's folder, every rank reads it once its weights are back);
  ``take_over(state)``: a per-rank component on rank 0, after a resume on fewer processes, adds the state of a rank
  the run no longer has to its own.

A hook does only what its component owns. Every collective a hook makes, it makes on every rank at the same step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


class Stop(enum.Enum):
    """Why the run ends before its total: a stop request (checkpoint, status ``stopped``) or ``--early_stop`` (the
    run finishes as at its total: the last validation, the LoRA file, a checkpoint)."""
    REQUESTED = "stop request"
    EARLY = "early stop"


@dataclass(frozen=True)
class Decision:
    """What the components ask of the recipe after a step, obeyed in this order: a stop request (a checkpoint, then
    the run stops), a checkpoint, a LoRA file, an early stop."""
    checkpoint: bool = False
    stop: Stop | None = None
    lora_file: str | None = None   # a LoRA file to write in the output folder (``step-N.safetensors``)

    def __or__(self, other: "Decision | None") -> "Decision":
        if other is None:
            return self
        stops = [stop for stop in (self.stop, other.stop) if stop is not None]
        return Decision(checkpoint=self.checkpoint or other.checkpoint,
                        stop=Stop.REQUESTED if Stop.REQUESTED in stops else (stops[0] if stops else None),
                        lora_file=self.lora_file or other.lora_file)


CONTINUE = Decision()


@dataclass
class StepResult:
    """One optimizer step as the recipe ran it."""
    loss: float                          # the mean of its micro-batches' losses
    lr: float                            # the learning rate it trained at
    grad_norm: float | None              # before clipping; None under DeepSpeed
    skipped: bool                        # non-finite on some rank: no update (the same on every rank)
    samples: int                         # samples it trained, the bad media replaced among them
    tokens: int
    bad_media: list[dict] = field(default_factory=list)   # the rows that could not be decoded ({"row", "reason"...})
    draws: list = field(default_factory=list)             # each sample's (timestep, loss, mode, shape)
    rows: list[int] = field(default_factory=list)         # each sample's row of the run's metadata, 0-based


@dataclass
class StepContext:
    """What a hook is told: the step just done (``step``: optimizer steps done so far, this one included; at start,
    those done before), the run's total, this step's result (None at start and at the end), the agreed sums of every
    rank's ``votes``, and a validation measured at this step (its record, which ``after_validation`` may add to)."""
    step: int
    epoch: int
    total_steps: int
    result: StepResult | None = None
    agreed: dict[str, int] = field(default_factory=dict)
    validation: dict | None = None
    stop: Stop | None = None     # a stop decided so far (at the end: why the run ended before its total)
    samples_seen: int = 0        # this rank's samples over the run so far


class Component:
    """A per-step feature; every hook does nothing unless the component says otherwise (module docstring)."""

    name: ClassVar[str] = ""
    per_rank: ClassVar[bool] = False   # its state differs per rank (saved for every rank)

    def votes(self, result: "StepResult") -> dict[str, int]:
        return {}

    def at_start(self, context: StepContext) -> Decision | None:
        return None

    def on_gradients(self, step: int, grad_norm, max_norm: float) -> None:
        pass

    def after_step(self, context: StepContext) -> Decision | None:
        return None

    def after_validation(self, context: StepContext) -> Decision | None:
        return None

    def after_training(self, context: StepContext) -> None:
        pass

    def at_end(self, context: StepContext) -> None:
        pass

    def failure_note(self, error: BaseException) -> str | None:
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def take_over(self, state: dict[str, Any]) -> None:
        pass

    def save_files(self, folder: Path) -> None:
        pass

    def load_files(self, folder: Path, step: int) -> None:
        pass


def run_hook(components, hook: str, context: StepContext) -> Decision:
    """``hook`` of every component in order; their decisions merged."""
    decision = CONTINUE
    for component in components:
        decision = decision | getattr(component, hook)(context)
        context.stop = context.stop or decision.stop   # the components after one that stops see it
    return decision
