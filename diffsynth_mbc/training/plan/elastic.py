"""A resume on another number of processes (GPUs or nodes), and where each epoch's optimizer steps fall from a
run's (re)start. Pure: no torch.

A checkpoint of N processes resumed on M: the epoch it was in goes on where it was. Its samples not trained yet are
shared out over the M processes (``batches.rest_of_epoch``: every sample of the epoch once), the later epochs are
dealt as this run deals them, and the run's steps are counted again for M (``EpochSteps``). The schedules (the
learning rate, ``--resolution_stages``) go on by samples seen: what was left of them is spread over the steps left
(``training/plan/schedule.py``). What else carries over: the LoRA and AdamW's state (fp32 under any precision),
the scheduler's step, each component's state (a vanished rank's taken over by rank 0), every rank's RNG where the
rank was there before (a new rank starts from its seed). Under DeepSpeed ZeRO-2 the optimizer state is sharded
over the N processes and the resume is refused, saying what to do (``checkpoints/state.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(frozen=True)
class EpochSteps:
    """The optimizer steps of a run's epochs from the position it (re)started at: ``step``, ``batches_done``
    batches per process into ``epoch``, whose batches per process are ``epoch_batches`` (the rest of it, after a
    resume on other processes, counts from 0); each later epoch has ``batches_per_epoch``."""
    step: int
    epoch: int
    batches_done: int
    epoch_batches: int
    batches_per_epoch: int
    accumulation: int

    @classmethod
    def fresh(cls, batches_per_epoch: int, accumulation: int) -> "EpochSteps":
        return cls(0, 0, 0, batches_per_epoch, batches_per_epoch, accumulation)

    @property
    def steps_left_in_epoch(self) -> int:
        return ceil_div(max(0, self.epoch_batches - self.batches_done), self.accumulation)

    @property
    def steps_per_epoch(self) -> int:
        return ceil_div(self.batches_per_epoch, self.accumulation)

    def first_step(self, epoch: int) -> int:
        """The optimizer step (0-based) ``epoch``'s first batch belongs to (the resumed epoch's: where its batches
        began, the ones already trained counted back)."""
        if epoch <= self.epoch:
            return self.step - self.batches_done // self.accumulation
        return self.step + self.steps_left_in_epoch + (epoch - self.epoch - 1) * self.steps_per_epoch

    def end_step(self, num_epochs: int) -> int:
        """The step the run ends at after ``num_epochs`` epochs."""
        return self.step if self.epoch >= num_epochs else self.first_step(num_epochs)


def describe_resume_elsewhere(from_world: int, to_world: int, now: EpochSteps, steps_left_before: int,
                              steps_per_epoch_before: int, num_epochs: int) -> str:
    """``resumed on 1 GPU from a 2-GPU checkpoint: 37 steps left in epoch 2, was 18 per GPU; ...``: what a resume on
    other processes changes, said once (the terminal, the status file's ``resumed_elsewhere``)."""
    gpus = f"{to_world} GPU{'s' if to_world != 1 else ''}"
    line = f"resumed on {gpus} from a {from_world}-GPU checkpoint: "
    if now.epoch >= num_epochs:
        return line + f"every epoch was trained by step {now.step}"
    line += f"{now.steps_left_in_epoch} steps left in epoch {now.epoch + 1}, was {steps_left_before} per GPU; "
    if now.epoch + 1 < num_epochs:
        line += f"the later epochs take {now.steps_per_epoch} steps each (were {steps_per_epoch_before}); "
    return line + (f"from step {now.step} the run ends at step {now.end_step(num_epochs)}; the learning-rate "
                   "schedule goes on by samples seen")
