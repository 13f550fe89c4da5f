"""The clips of a sweep and which are still to render. Pure: no torch.

Every prompt at strength 0 once (the base model: ``base/NN-slug-base``) and at every other strength with every file
(``<file key>/NN-slug`` at strength 1, ``NN-slug-s0.5`` at 0.5: the names the training's sample clips have). Files are
rendered one after the other (a file's weights load once), prompts inside. A clip is rendered already when its mp4
and png exist and the sweep's record says they were made of the same things: the prompt's settings and its first
frame's bytes, the file's bytes, the strength, and the model, precision and device that render it (a file rewritten
at the same path, another --seed of the demo model or another --model_dir is rendered again). Every clip's path
stays inside the output folder."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from diffsynth_mbc.data.cache.index import file_sha256
from diffsynth_mbc.run_layout import BASE_SAMPLES_FOLDER, SWEEP_JSON
from diffsynth_mbc.sample_prompts import SamplePrompt, clip_suffix, sample_file_stem
from diffsynth_mbc.values import finite_number


@dataclass(frozen=True)
class Clip:
    prompt_index: int          # into the prompts, from 0
    file_index: int | None     # into the files; None: the base model
    strength: float
    path: str                  # relative to the output folder, without extension: "step-00000040/01-a-news-anchor"
    settings: str              # digest of what makes the clip: prompt, first frame, file bytes, strength, model


def plan_clips(prompts: list[SamplePrompt], files: list, strengths: list[float], rendering: dict) -> list[Clip]:
    """``rendering``: what renders every clip besides the prompt, file and strength (model, precision, device)."""
    images = {prompt.image: file_sha256(prompt.image) for prompt in prompts if prompt.image}
    clips = []
    if 0 in strengths:
        for index, prompt in enumerate(prompts):
            stem = sample_file_stem(index, prompt) + clip_suffix(0.0, "raw")
            clips.append(Clip(index, None, 0.0, f"{BASE_SAMPLES_FOLDER}/{stem}",
                              _digest(prompt, images, None, 0.0, rendering)))
    for file_index, item in enumerate(files):
        for strength in [s for s in strengths if s != 0]:
            for index, prompt in enumerate(prompts):
                stem = sample_file_stem(index, prompt) + clip_suffix(strength, "raw")
                clips.append(Clip(index, file_index, strength, inside_output(f"{item.key}/{stem}", item.path),
                                  _digest(prompt, images, item.digest, strength, rendering)))
    return clips


def inside_output(path: str, file: str) -> str:
    """``path`` when it is a plain relative path (no ``..``, no root): ValueError naming ``file`` otherwise."""
    parts = PurePosixPath(path).parts
    if PurePosixPath(path).is_absolute() or any(part in ("", ".", "..") or part.startswith(".") for part in parts):
        raise ValueError(f"{file}: its clips would be written to {path!r}, outside the sweep's --output folder")
    return path


def _digest(prompt: SamplePrompt, images: dict, file: str | None, strength: float, rendering: dict) -> str:
    made_of = {"prompt": prompt.as_dict(), "image": images.get(prompt.image), "file": file, "strength": strength,
               "rendering": rendering}
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:16]


def rendered(clip: Clip, output: Path, records: dict[str, dict]) -> bool:
    """Whether ``clip`` is there from an earlier invocation, made of the same settings."""
    record = records.get(clip.path)
    return bool(record and record.get("settings") == clip.settings and (output / f"{clip.path}.mp4").is_file()
                and (output / f"{clip.path}.png").is_file())


def read_records(output: Path) -> dict[str, dict]:
    """The clips an earlier invocation recorded in ``sweep.json``, by path; {} when there is none or it is unreadable
    (every clip is then rendered again)."""
    try:
        saved = json.loads((output / SWEEP_JSON).read_text(encoding="utf-8"))
        return {record["path"]: record for record in saved.get("clips") or [] if isinstance(record, dict)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def best_file(files: list[dict], base_val_loss: float | None) -> dict | None:
    """The file with the lowest finite validation loss (ties: the earlier step), with its gain over the base model
    (``(base - best) / base``); None when no file was validated to a finite loss (a NaN is never the best)."""
    validated = [item for item in files if finite_number(item.get("val_loss")) is not None]
    if not validated:
        return None
    best = min(validated, key=lambda item: (item["val_loss"], item["step"] is None, item["step"] or 0))
    base = finite_number(base_val_loss)
    gain = (base - best["val_loss"]) / base if base else None
    return {"key": best["key"], "label": best["label"], "path": best["path"], "step": best["step"],
            "run": best.get("run"), "val_loss": best["val_loss"], "val_loss_base": base_val_loss, "gain": gain}


def gain_words(gain: float) -> str:
    """A loss's gain over the base model's, as the dashboard's Best LoRA card says it: ``15.90% below the base``
    (``2.00% above the base`` for a loss above it)."""
    return f"{abs(gain):.2%} {'below' if gain >= 0 else 'above'} the base"


def judging_notes(used: dict, own: dict[str, dict], files: list) -> list[str]:
    """What the sheet and the terminal say of the validation: the settings every file's figures are measured at
    (``used``: the first run's, then the flags given), and each run whose own validation settings (``own``, by its
    output folder) differ, whose figures here are then not its own records."""
    from diffsynth_mbc.training.evaluation.validation import settings_text

    lines = [settings_text(used)]
    names = {item.run_dir: item.run or item.run_dir for item in files if item.run_dir}
    for run_dir, settings in own.items():
        changed = [key for key in used if settings.get(key) != used[key]]
        if changed:
            lines.append(f"{names.get(run_dir, run_dir)}: its own validation is at "
                         + ", ".join(f"{key} {settings.get(key)}" for key in changed)
                         + "; its figures here are measured at the settings above, not its run's")
    return lines
