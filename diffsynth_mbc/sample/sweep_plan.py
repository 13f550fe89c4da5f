"""The clips of a sweep and which are still to render. Pure: no torch.

Every prompt at strength 0 once (the base model: ``base/NN-slug-base``) and at every other strength with every file
(``<file key>/NN-slug`` at strength 1, ``NN-slug-s0.5`` at 0.5: the names the training's sample clips have). Files are
rendered one after the other (a file's weights load once), prompts inside. A clip is rendered already when its mp4
and png exist and the sweep's record says they were made for the same prompt settings and file (a prompt whose seed,
size or text changed is rendered again)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from diffsynth_mbc.run_layout import BASE_SAMPLES_FOLDER, SWEEP_JSON
from diffsynth_mbc.sample_prompts import SamplePrompt, clip_suffix, sample_file_stem


@dataclass(frozen=True)
class Clip:
    prompt_index: int          # into the prompts, from 0
    file_index: int | None     # into the files; None: the base model
    strength: float
    path: str                  # relative to the output folder, without extension: "step-00000040/01-a-news-anchor"
    settings: str              # digest of what makes the clip: the prompt's settings, the file and the strength


def plan_clips(prompts: list[SamplePrompt], files: list, strengths: list[float]) -> list[Clip]:
    clips = []
    if 0 in strengths:
        for index, prompt in enumerate(prompts):
            stem = sample_file_stem(index, prompt) + clip_suffix(0.0, "raw")
            clips.append(Clip(index, None, 0.0, f"{BASE_SAMPLES_FOLDER}/{stem}", _digest(prompt, None, 0.0)))
    for file_index, item in enumerate(files):
        for strength in [s for s in strengths if s != 0]:
            for index, prompt in enumerate(prompts):
                stem = sample_file_stem(index, prompt) + clip_suffix(strength, "raw")
                clips.append(Clip(index, file_index, strength, f"{item.key}/{stem}",
                                  _digest(prompt, item.path, strength)))
    return clips


def _digest(prompt: SamplePrompt, file: str | None, strength: float) -> str:
    made_of = {"prompt": prompt.as_dict(), "file": file, "strength": strength}
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
    """The file with the lowest validation loss (ties: the earlier step), with its gain over the base model
    (``(base - best) / base``); None when no file was validated."""
    validated = [item for item in files if item.get("val_loss") is not None]
    if not validated:
        return None
    best = min(validated, key=lambda item: (item["val_loss"], item["step"] is None, item["step"] or 0))
    gain = (base_val_loss - best["val_loss"]) / base_val_loss if base_val_loss else None
    return {"key": best["key"], "label": best["label"], "path": best["path"], "step": best["step"],
            "val_loss": best["val_loss"], "val_loss_base": base_val_loss, "gain": gain}
