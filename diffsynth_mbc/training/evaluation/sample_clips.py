"""Sample clips during training with DiffSynth's own ``WanVideoPipeline.__call__`` and the LoRA as it is.

Rank 0 generates every prompt of ``--sample_prompts`` (in eval mode, without gradients, inside a forked
RNG so training draws the same numbers as without sampling) and writes
``OUTPUT/samples/step-000NNNNN/NN-<slug>.mp4`` plus the first frame as png, each through a temp file and a
rename; the slug only summarises the prompt, whose full text is in ``prompts.json`` beside the clips. Its status
phase moves with every denoising step; the other ranks wait at an asynchronous barrier and keep their status
fresh meanwhile, so the monitor never calls a sampling run stalled.

``--sample_strengths 0,0.5,1`` renders each prompt at each strength of the LoRA (``training/lora/strength.py``),
with the prompt's seed every time: ``NN-<slug>-s0.5.mp4``, strength 1 under the names clips always had, each also
with the EMA (``-ema``) where ``--validate_with both|ema`` asks for it (``sample_prompts.clip_suffix``). Strength 0
is the base model, which training does not change: its clips go to ``OUTPUT/samples/base/NN-<slug>-base.mp4``
once per prompt (the first time samples are made; again only for a prompt whose settings changed, e.g. on a
resume with another prompt file), and its ``prompts.json`` says at which step each was rendered.
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path

from diffsynth_mbc.atomic import atomic_open, atomic_path, atomic_write_json
from diffsynth_mbc.data.media.orientation import upright
from diffsynth_mbc.run_layout import BASE_SAMPLES_FOLDER, PROMPTS_FILE, SAMPLES_FOLDER, sample_set_name
from diffsynth_mbc.sample_prompts import (BASE_SUFFIX, SamplePrompt, clip_suffix, prompts_file_record, sample_file_stem,
                                          sampling_due, strength_text)
from diffsynth_mbc.training.distributed.accelerator import unwrapped_model
from diffsynth_mbc.training.lora.ema import weights_for
from diffsynth_mbc.training.lora.strength import lora_strength

FPS = 16
WAIT_POLL_S = 1.0


class Sampler:
    def __init__(self, options, status, prompts: list[SamplePrompt], contexts: dict | None = None):
        self.options, self.status, self.prompts = options, status, prompts
        self.every = options.sample_steps
        self.strengths = list(options.sample_strengths)   # ascending; 0: the base model
        self.root = Path(options.output_path) / SAMPLES_FOLDER
        self.contexts = contexts    # prompt text -> embedding from the latent cache (no text encoder loaded)
        self.accelerator = self.module = None
        self.last_step: int | None = None
        self.ema = None             # the run's LoraEma: --validate_with ema|both render with it (NN-slug-ema.mp4)

    def attach(self, accelerator, module) -> None:
        self.accelerator, self.module = accelerator, module

    def due(self, step: int, total_steps: int, first_step: int) -> bool:
        return step != self.last_step and sampling_due(step, self.every, total_steps, first_step=first_step)

    def run(self, step: int) -> None:
        """Every rank calls this at the same step; rank 0 samples, the others wait for it."""
        self.last_step = step
        accelerator = self.accelerator
        if accelerator.is_main_process:
            started = time.monotonic()
            paths = self._generate_all(step)
            self._record(step, paths, time.monotonic() - started)
        self._wait_for_main(step)

    # -- rank 0 -------------------------------------------------------------------------------
    def _generate_all(self, step: int) -> list[Path]:
        """Every clip of this sample step (and the base model's not made yet): the paths written."""
        import torch

        pipe = unwrapped_model(self.accelerator, self.module).pipe
        target = self.root / sample_set_name(step)
        target.mkdir(parents=True, exist_ok=True)
        atomic_write_json(target / PROMPTS_FILE, prompts_file_record(self.prompts))   # before the clips it names
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        was_training = pipe.dit.training
        training_scheduler = copy.deepcopy(pipe.scheduler)   # generation re-times it for its few steps
        pipe.dit.eval()
        paths = []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices), \
                    _prompts_from(pipe, self.contexts):
                if 0 in self.strengths:
                    paths += self._generate_base(pipe, step)
                for weights in self._weights():
                    with self.ema.weights(weights) if self.ema is not None else contextlib.nullcontext():
                        for strength in [s for s in self.strengths if s != 0]:
                            with lora_strength(pipe.dit, strength):
                                for index, prompt in enumerate(self.prompts):
                                    frames = self._generate(pipe, prompt, step, index, _label(strength, weights))
                                    stem = sample_file_stem(index, prompt) + clip_suffix(strength, weights)
                                    paths += self._write(target, stem, frames)
        finally:
            pipe.scheduler = training_scheduler
            pipe.dit.train(was_training)
            if devices:
                torch.cuda.empty_cache()
        return paths

    def _generate_base(self, pipe, step: int) -> list[Path]:
        """The base model's clip of every prompt that has none for its current settings (strength 0: the LoRA adds
        nothing); ``base/prompts.json`` names the prompts whose clips are current and the step each was made at."""
        folder = self.root / BASE_SAMPLES_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        made = read_base_records(folder)
        current, paths = {}, []
        for index, (prompt, record) in enumerate(zip(self.prompts, prompts_file_record(self.prompts)["prompts"])):
            stem = record["stem"] + BASE_SUFFIX
            before = made.get(record["index"])
            if before is not None and before == {**record, "step": before.get("step")} \
                    and (folder / f"{stem}.mp4").is_file():
                current[record["index"]] = before
                continue
            with lora_strength(pipe.dit, 0.0):
                frames = self._generate(pipe, prompt, step, index, _label(0.0, "raw"))
            paths += self._write(folder, stem, frames)
            current[record["index"]] = {**record, "step": step}
            atomic_write_json(folder / PROMPTS_FILE, {"prompts": [current[k] for k in sorted(current)]})
        atomic_write_json(folder / PROMPTS_FILE, {"prompts": [current[k] for k in sorted(current)]})
        stems = {record["stem"] + BASE_SUFFIX for record in current.values()}
        for stale in folder.iterdir():   # clips of prompts the file no longer has
            if stale.suffix in (".mp4", ".png") and stale.stem not in stems:
                stale.unlink(missing_ok=True)
        return paths

    def _weights(self) -> list[str]:
        return ["raw"] if self.ema is None else weights_for(self.options.validate_with, self.ema.updates)

    def _generate(self, pipe, prompt: SamplePrompt, step: int, index: int, label: str = "") -> list:
        def said(number: int) -> None:
            self.status.update(phase=f"sampling at step {step}: prompt {index + 1}/{len(self.prompts)}{label}, "
                                     f"denoising {number}/{prompt.steps}")
        return generate_clip(pipe, prompt, self.accelerator, said)

    def _write(self, target: Path, stem: str, frames: list) -> list[Path]:
        return write_clip(target, stem, frames)

    def _record(self, step: int, paths: list[Path], seconds: float) -> None:
        """The history line and status of a sample set: ``files`` in the set's folder; with strength 0 in
        --sample_strengths also ``base_dir`` and ``base_files``, the base model's clips made at this step."""
        folder = self.root / sample_set_name(step)
        files = [path.name for path in paths if path.parent == folder]
        where = {"dir": str(folder), "files": files}
        if 0 in self.strengths:
            where.update(base_dir=str(self.root / BASE_SAMPLES_FOLDER),
                         base_files=[path.name for path in paths if path.parent != folder])
        record = {"kind": "samples", "step": step, **where, "prompts": [p.prompt for p in self.prompts],
                  "strengths": self.strengths, "seconds": round(seconds, 2), "time": round(time.time(), 3)}
        self.status.append_history(record)
        self._to_trackers(step, paths)
        self.status.update(samples_dir=str(self.root.resolve()), last_samples={"step": step, **where})

    def _to_trackers(self, step: int, paths: list[Path]) -> None:
        """Samples for --report_to: W&B gets the clips as videos captioned with their prompts; TensorBoard (whose
        video panel needs moviepy) the first frames as images, and each full prompt as text beside them. A clip's
        tag is its file's stem (``samples/01-a-news-anchor``, ``...-s0.5``, ``...-ema``, ``...-base``)."""
        import numpy as np
        from PIL import Image

        def text(stem: str) -> str:   # every stem starts with its prompt's number
            number = int(stem[:2]) if stem[:2].isdigit() else 0
            return self.prompts[number - 1].prompt if 1 <= number <= len(self.prompts) else ""

        for tracker in getattr(self.accelerator, "trackers", None) or []:
            for path in paths:
                stem, suffix = path.stem, path.suffix
                if tracker.name == "tensorboard" and suffix == ".png":
                    still = np.asarray(Image.open(path).convert("RGB"))
                    tracker.writer.add_image(f"samples/{stem}", still, global_step=step, dataformats="HWC")
                    tracker.writer.add_text(f"samples/{stem}/prompt", text(stem), global_step=step)
                elif tracker.name == "wandb" and suffix == ".mp4":
                    import wandb

                    tracker.log({f"samples/{stem}": wandb.Video(str(path), caption=text(stem), format="mp4")},
                                step=step)

    # -- every rank ----------------------------------------------------------------------------
    def _wait_for_main(self, step: int) -> None:
        accelerator = self.accelerator
        if accelerator.num_processes == 1:
            return
        import torch.distributed as dist

        if accelerator.is_main_process:
            dist.barrier()
            return
        started = time.monotonic()
        work = dist.barrier(async_op=True)
        while not work.is_completed():
            self.status.update(phase=f"waiting for rank 0's samples at step {step} "
                                     f"({time.monotonic() - started:.0f} s)")
            time.sleep(WAIT_POLL_S)
        work.wait()


def generate_clip(pipe, prompt: SamplePrompt, accelerator, on_step=None) -> list:
    """The clip of ``prompt`` (PIL frames) by DiffSynth's ``WanVideoPipeline.__call__`` with the pipeline's weights as
    they are (the LoRA at its strength), the prompt's seed drawing the noise on the accelerator's device, under its
    autocast: the one sampler of the training's sample steps and of ``python -m diffsynth_mbc.sample``.
    ``on_step(n)`` is told each denoising step."""
    from PIL import Image

    def heartbeat(timesteps):
        for number, timestep in enumerate(timesteps, 1):
            if on_step is not None:
                on_step(number)
            yield timestep

    image = upright(Image.open(prompt.image)).convert("RGB").resize((prompt.width, prompt.height)) \
        if prompt.image else None
    with accelerator.autocast():
        return pipe(prompt=prompt.prompt, negative_prompt=prompt.negative_prompt, input_image=image,
                    seed=prompt.seed, height=prompt.height, width=prompt.width, num_frames=prompt.num_frames,
                    num_inference_steps=prompt.steps, cfg_scale=prompt.cfg_scale, tiled=False,
                    rand_device=str(accelerator.device), progress_bar_cmd=heartbeat)


def write_clip(target: Path, stem: str, frames: list) -> list[Path]:
    """``target/stem.mp4`` and its first frame ``stem.png``, each through a temp file and a rename."""
    video, still = target / f"{stem}.mp4", target / f"{stem}.png"
    with atomic_path(video, suffix=".mp4") as tmp:   # the encoder picks the format from the name
        write_video(frames, str(tmp), fps=FPS, quality=8)
    with atomic_open(still, "wb") as handle:
        frames[0].save(handle, format="PNG")
    return [video, still]


def _label(strength: float, weights: str) -> str:
    """What the status phase adds for a clip other than the trained LoRA's: " (base model)", " (strength 0.5, EMA)"."""
    if strength == 0:
        return " (base model)"
    parts = ([] if strength == 1 else [f"strength {strength_text(strength)}"]) + (["EMA"] if weights == "ema" else [])
    return f" ({', '.join(parts)})" if parts else ""


def read_base_records(folder: Path) -> dict[int, dict]:
    """Prompt number -> the settings (and ``step``) of its current base-model clip, from ``base/prompts.json``."""
    import json

    try:
        entries = json.loads((folder / PROMPTS_FILE).read_text(encoding="utf-8")).get("prompts")
    except (OSError, ValueError, AttributeError):
        return {}
    return {entry["index"]: entry for entry in entries or [] if isinstance(entry, dict) and "index" in entry}


def write_video(frames: list, path: str, fps: int, quality: int) -> None:
    """DiffSynth's ``save_video`` (the same imageio writer and settings) without its tqdm bar, which drew
    "Saving video: 0%|" lines on the launcher's terminal and into the log beside the live bar."""
    import imageio
    import numpy as np

    writer = imageio.get_writer(path, fps=fps, quality=quality)
    try:
        for frame in frames:
            writer.append_data(np.array(frame))
    finally:
        writer.close()


def make_sampler(options, status, accelerator, module, ema=None):
    from diffsynth_mbc.sample_prompts import run_sample_prompts

    prompts = run_sample_prompts(options)
    contexts = None
    if options.cache:   # no text encoder in a cached run: the cache holds the prompts' embeddings
        from diffsynth_mbc.data.cache.sample_texts import read_sample_texts, texts_of
        contexts = read_sample_texts(Path(options.cache), texts_of(prompts))
    sampler = Sampler(options, status, prompts, contexts)
    sampler.attach(accelerator, module)
    sampler.ema = ema
    return sampler


@contextlib.contextmanager
def _prompts_from(pipe, contexts: dict | None):
    """While sampling from a cached run, DiffSynth's prompt unit gets each text's embedding from the cache."""
    if contexts is None:
        yield
        return

    def encode_prompt(prompt, positive=True, device=None, **kwargs):
        return contexts[prompt].to(device=device or pipe.device, dtype=pipe.torch_dtype)[None]

    pipe.prompter.encode_prompt = encode_prompt   # an instance attribute over the class's method
    try:
        yield
    finally:
        del pipe.prompter.encode_prompt
