"""Which LoRA files a sweep renders: files, checkpoint folders, or a run's output folder (every LoRA file the run
wrote: ``lora.safetensors``, ``lora-best``, ``epoch-*``, ``step-*``, each checkpoint's; with ``ema`` their EMA
twins), ordered by
step. Each file's step, run id, base model and variant come from its metadata (the header alone is read). Files of
one run at one step hold the same weights (the run writes them from the same parameters): one of them is rendered.

Each file's key names the folder its clips go to, one plain name per file of the sweep: files of several runs (or
folders) are kept apart under their run's name (``runa-lora/lora``, ``runb-lora/lora``), a name that is a path
(``..``), hidden or the sweep's own (``base``, ``sweep.json``) is made plain, and a name met twice gets ``-2``.
No torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from diffsynth_mbc.data.cache.index import file_sha256
from diffsynth_mbc.run_layout import (BASE_SAMPLES_FOLDER, BEST_LORA_STEM, CHECKPOINT_LORA, CHECKPOINT_MANIFEST,
                                      DEFAULT_CHECKPOINTS_FOLDER, EMA_TWIN_SUFFIX, EPOCH_PREFIX, FINAL_LORA, LORA_FILE,
                                      RUN_OPTIONS, STEP_PREFIX, SWEEP_HTML, SWEEP_JSON, step_folder_name)
from diffsynth_mbc.training.lora.read import file_metadata_of

# of one run's files at one step, the one kept
NAMED_FIRST = ("lora", "step", "epoch", "checkpoint", BEST_LORA_STEM)
SWEEP_NAMES = (BASE_SAMPLES_FOLDER, SWEEP_JSON, SWEEP_HTML)   # what the sweep's folder holds besides the files' folders


class SweepFileError(ValueError):
    """A --lora argument that names no LoRA file, or a file for another base model; the path named."""


@dataclass(frozen=True)
class SweepFile:
    path: str               # absolute
    label: str              # what the sheet heads its column with: "step-40", "epoch-002", "checkpoint step-00000040"
    key: str                # the folder its clips go to: "step-00000040", "epoch-002", "lora", "checkpoint-00000040"
    step: int | None
    run_id: str | None
    variant: str            # "raw" or "ema"
    base_model: str | None
    run_dir: str | None     # the run's output folder when the file is one of a run's (its validation settings)
    folder: str = ""        # the run's output folder, or the folder of a file of no run: what "several runs" counts
    run: str | None = None  # the sheet's name of that folder ("runa/lora") when the sweep holds several
    source: int = 0         # which --lora argument named it
    digest: str = ""        # sha256 of the file's bytes (with_digests): what its clips and figures are kept for

    def as_dict(self) -> dict:
        return {"path": self.path, "label": self.label, "key": self.key, "step": self.step, "run_id": self.run_id,
                "variant": self.variant, "base_model": self.base_model, "run_dir": self.run_dir, "run": self.run,
                "sha256": self.digest or None}


def sweep_files(sources: list[str], ema: bool = False) -> list[SweepFile]:
    """Every LoRA file ``sources`` name, ordered by step (files without one last, in the order given), each with a
    key of its own."""
    found: list[SweepFile] = []
    for number, source in enumerate(sources):
        found += [replace(item, source=number) for item in _files_of(Path(source), ema)]
    kept: dict[tuple, SweepFile] = {}
    for item in found:
        same = (item.folder, item.run_id, item.step, item.variant) if item.run_id and item.step is not None \
            else (item.path,)
        if same not in kept or _rank(item) < _rank(kept[same]):
            kept[same] = item
    ordered = sorted(kept.values(), key=lambda f: (f.step is None, f.step if f.step is not None else 0,
                                                   f.variant == "ema", _rank(f)))
    return _keyed(ordered)


def with_digests(files: list[SweepFile]) -> list[SweepFile]:
    """The files with the sha256 of their bytes: a file rewritten at the same path (a resume, --start_over) is
    another file to the sweep."""
    return [replace(item, digest=file_sha256(item.path)) for item in files]


def plain_name(text: str) -> str:
    """``text`` as one file name: letters, digits, '.', '_' and '-' (others become '-'), never hidden or a path
    (``..``, ``.``, ``a/b``)."""
    return re.sub(r"[^\w.-]+", "-", text).strip(".-") or "file"


def _keyed(files: list[SweepFile]) -> list[SweepFile]:
    """Each file's key made plain and unique, under its run's name when the files are of several runs (folders)."""
    names = run_names([item.folder for item in files])
    taken = {name.casefold() for name in SWEEP_NAMES}
    keyed = []
    for item in files:
        run = names.get(item.folder)
        key = plain_name(item.key)
        key = f"{plain_name(run.replace('/', '-'))}/{key}" if run else key
        unique, number = key, 1
        while unique.casefold() in taken:
            number += 1
            unique = f"{key}-{number}"
        taken.add(unique.casefold())
        keyed.append(replace(item, key=unique, run=run))
    return keyed


def run_names(folders: list[str]) -> dict[str, str]:
    """{folder: its shortest trailing path that tells it from the others ("runa/lora", "runb/lora")}; {} for one
    folder (a sweep of one run names none)."""
    distinct = list(dict.fromkeys(folders))
    if len(distinct) < 2:
        return {}
    parts = {folder: Path(folder).parts for folder in distinct}
    for length in range(1, max(len(value) for value in parts.values()) + 1):
        names = {folder: str(Path(*value[-length:])) for folder, value in parts.items()}
        if len(set(names.values())) == len(names):
            return names
    return {folder: folder for folder in distinct}


def refuse_other_base(files: list[SweepFile], base_model: str) -> None:
    """SweepFileError naming the first file whose metadata names another base model than ``base_model``."""
    for item in files:
        if item.base_model and item.base_model != base_model:
            raise SweepFileError(f"{item.path}: made for {item.base_model}, not {base_model}; a LoRA renders "
                                 "only with the base model it was trained on")


def _rank(item: SweepFile) -> int:
    kind = BEST_LORA_STEM if item.key.startswith(BEST_LORA_STEM) else item.key.split("-")[0]
    return NAMED_FIRST.index(kind) if kind in NAMED_FIRST else len(NAMED_FIRST)


def _files_of(source: Path, ema: bool) -> list[SweepFile]:
    if source.is_file():
        return [_described(source, None)]
    if not source.is_dir():
        raise SweepFileError(f"--lora {source}: no such file or folder")
    if (source / CHECKPOINT_MANIFEST).is_file():
        return [_described(source / CHECKPOINT_LORA, None, checkpoint=source.resolve().name)]
    files = [_described(path, source) for path in sorted(source.iterdir())
             if LORA_FILE.match(path.name) and (ema or not path.stem.endswith(EMA_TWIN_SUFFIX))]
    checkpoints = source / DEFAULT_CHECKPOINTS_FOLDER
    if checkpoints.is_dir():
        files += [_described(folder / CHECKPOINT_LORA, source, checkpoint=folder.name)
                  for folder in sorted(checkpoints.iterdir())
                  if (folder / CHECKPOINT_MANIFEST).is_file() and (folder / CHECKPOINT_LORA).is_file()]
    if not files:
        raise SweepFileError(f"--lora {source}: a folder with no LoRA file ({FINAL_LORA}, {EPOCH_PREFIX}*, "
                             f"{STEP_PREFIX}*), no {CHECKPOINT_MANIFEST} and no {DEFAULT_CHECKPOINTS_FOLDER}/ of a run")
    return files


def _described(path: Path, run_dir: Path | None, checkpoint: str | None = None) -> SweepFile:
    if not path.is_file():
        raise SweepFileError(f"--lora {path}: no such LoRA file")
    metadata = file_metadata_of(path)
    step = int(metadata["step"]) if str(metadata.get("step") or "").isdigit() else None
    variant = "ema" if path.stem.endswith(EMA_TWIN_SUFFIX) else "raw"
    if checkpoint:
        label = f"checkpoint {checkpoint}"
        key = f"checkpoint-{checkpoint.removeprefix(STEP_PREFIX)}"
    else:
        label = path.stem
        stem = path.stem.removesuffix(EMA_TWIN_SUFFIX)
        key = step_folder_name(step) if stem.startswith(STEP_PREFIX) and step is not None else stem
        key += EMA_TWIN_SUFFIX if variant == "ema" else ""
    if run_dir is None:   # a file or checkpoint of a run: the run's output folder, where its options are kept
        run_dir = path.parent.parent.parent if checkpoint else path.parent
    folder = Path(run_dir).resolve()
    run_dir = run_dir if (Path(run_dir) / RUN_OPTIONS).is_file() else None
    return SweepFile(path=str(path.resolve()), label=label, key=key, step=step,
                     run_id=metadata.get("run_id") or None, variant=variant,
                     base_model=metadata.get("base_model") or None,
                     run_dir=str(Path(run_dir).resolve()) if run_dir is not None else None, folder=str(folder))
