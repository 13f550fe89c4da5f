"""The LoRA files a run writes (``lora.safetensors``, ``epoch-001``, ``step-N``, each checkpoint's): taken from the
trainable parameters, in the ``--lora_format`` layout with alpha/rank folded in, and never with a NaN or inf in
them. A mixin of ``checkpoints.Checkpoints`` (which holds the accelerator, module, options and status); torch is
imported inside its methods.
"""

from __future__ import annotations

from pathlib import Path

from diffsynth_mbc.atomic import atomic_save_safetensors
from diffsynth_mbc.training.distributed.accelerator import unwrapped_model
from diffsynth_mbc.training.distributed.collectives import all_reduce_sum, wait_for_everyone
from diffsynth_mbc.training.lora.ema import save_ema_lora
from diffsynth_mbc.training.lora.file_format import (
    NonFiniteLoraError,
    convert,
    describe_nonfinite,
    file_metadata,
    nonfinite_tensors,
    training_metadata,
    training_scale,
)


class LoraFiles:
    """Writing the run's LoRA files; ``Checkpoints`` provides accelerator, module, options, status and root."""

    ema = None   # the run's LoraEma (--ema_decay): its file is written beside each LoRA file (set by Checkpoints)

    def lora_tensors(self) -> dict:
        """The trainable (LoRA) tensors in DiffSynth's training layout, taken from the parameters themselves.

        Never ``accelerator.get_state_dict``: that gathers the whole 5B model to the CPU on every rank. DDP and
        ZeRO-2 keep every parameter whole on every rank (ZeRO-2 shards only gradients and optimizer state).
        """
        model = unwrapped_model(self.accelerator, self.module)
        trainable = {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}
        lora = model.lora_state_dict(trainable)
        return {key: value.detach().to("cpu").contiguous() for key, value in lora.items()}

    def file_tensors(self, tensors: dict) -> dict:
        """What a LoRA file holds: ``--lora_format`` layout, alpha/rank folded in (see lora_format)."""
        from diffsynth_mbc.training.lora.variants import dora_norm_ratios

        options = self.options
        ratios = dora_norm_ratios(unwrapped_model(self.accelerator, self.module).pipe.dit) \
            if options.lora_variant == "dora" else None
        return convert(tensors, options.lora_format, scale=training_scale(options.lora_rank, options.lora_alpha),
                       dora_ratios=ratios)

    def checked_file_tensors(self, tensors: dict, target: Path, waiting_for: str) -> dict:
        """The file's tensors, or NonFiniteLoraError on every rank if any holds NaN/inf (collective: all ranks call
        it, each waiting as ``waiting_for``). Nothing is written then, so the last good checkpoint and LoRA files stay
        what they were."""
        import torch

        from diffsynth_mbc.training.checkpoints.folder import find_latest

        converted = self.file_tensors(tensors)
        found = nonfinite_tensors(converted)
        anywhere = int(all_reduce_sum(self.accelerator, torch.tensor([len(found)], device=self.accelerator.device),
                                      self.status, waiting_for))
        if anywhere:
            last = find_latest(self.root)
            raise NonFiniteLoraError(
                f"refusing to write {target}: " + (describe_nonfinite(found, len(converted)) if found else
                                                   "LoRA tensors hold NaN or infinite values on another rank")
                + f". The LoRA is broken; nothing was written. Last good checkpoint: {last or 'none'}; lower "
                "--learning_rate (or --lora_alpha) and continue from it with --resume latest")
        return converted

    def write_lora(self, target: Path, step: int, file_tensors: dict) -> None:
        """``target`` with what the file is (layout, rank, alpha, base model, step, run) and what trained it
        (``training_metadata``: the step plan the status file holds) in its metadata."""
        options = self.options
        atomic_save_safetensors(target, file_tensors, metadata={**file_metadata(
            rank=options.lora_rank, alpha=options.lora_alpha, targets=options.lora_target_modules.text,
            base_model="Wan2.2-TI2V-5B" + (" (demo)" if options.demo else ""), step=step,
            run_id=str(self.status.state["run_id"]), layout=options.lora_format, variant=options.lora_variant),
            **training_metadata(options, self.status.state.get("plan"), step)})

    def save_lora(self, file_name: str, step: int) -> None:
        """Rank 0 writes the LoRA (``--lora_format``, loadable by DiffSynth and ComfyUI): temp file, then rename.
        A LoRA holding NaN or inf is never written (NonFiniteLoraError on every rank)."""
        self.status.update(phase=f"saving {file_name}")
        others = f"ranks saving {file_name}"   # a rank blocked at a barrier says so (a hung one does not)
        wait_for_everyone(self.accelerator, self.status, others)
        target = Path(self.options.output_path) / file_name
        file_tensors = self.checked_file_tensors(self.lora_tensors(), target, others)
        if self.accelerator.is_main_process:
            self.write_lora(target, step, file_tensors)
        if self.ema is not None:
            save_ema_lora(self, target, step)
        wait_for_everyone(self.accelerator, self.status, others)
