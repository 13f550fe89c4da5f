"""``--ema_decay``: the EMA of the LoRA weights (``training/lora/ema.LoraEma``) moved after every optimizer step that
was taken (a step skipped as non-finite is not averaged in), kept in every checkpoint (``ema_state.safetensors``)
and restored on a resume: a checkpoint made without one starts the EMA from its weights, said once."""

from __future__ import annotations

import sys
from pathlib import Path

from diffsynth_mbc.training.components.protocol import Component, StepContext


class EmaUpdates(Component):
    name = "ema"

    def __init__(self, ema, status, is_main: bool):
        self.ema, self.status, self.is_main = ema, status, is_main

    def after_step(self, context: StepContext) -> None:
        self.ema.after_step(context.result.skipped)

    def save_files(self, folder: Path) -> None:
        self.ema.save_state(folder)

    def load_files(self, folder: Path, step: int) -> None:
        """After the checkpoint's weights are back: its EMA, or (a checkpoint made without one) a fresh EMA."""
        if self.ema.load_state(folder):
            self.status.update(ema_updates=self.ema.updates)
            return
        self.ema.reset()
        message = f"{folder} holds no EMA of the LoRA: the EMA starts from its weights at step {step}"
        if self.is_main:
            print(f"note: {message}", file=sys.stderr)
        self.status.update(ema_note=message)
