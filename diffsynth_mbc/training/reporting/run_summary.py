"""What the end of a run says it achieved and wrote: the validation loss against the base model (the LoRA off, see
``training/evaluation/validation.py``), every LoRA file this run wrote in its output folder, and the bad media files
replaced by other rows (counted and named over every rank and the whole run, a resume's checkpoint included). Pure
formatting from the status file's fields and the files' own metadata (their run id), and the one gather that brings
every rank's replaced files to rank 0's status; no torch.
"""

from __future__ import annotations

from pathlib import Path

from diffsynth_mbc.run_layout import BEST_LORA, EPOCH_PREFIX, FINAL_LORA, LORA_FILE, STEP_PREFIX, ema_twin_name
from diffsynth_mbc.training.checkpoints.owner import lora_file_owner
from diffsynth_mbc.training.components.best_lora import standing_note
from diffsynth_mbc.values import finite_number

NUMBERED = {"epoch": EPOCH_PREFIX, "step": STEP_PREFIX}   # the numbered LoRA files, by kind
REPLACED_ROWS_KEPT = 100   # rows named in the status file (every one is counted)
REPLACED_ROWS_SAID = 5     # rows named in the summary


def against_base(loss: float, base: float) -> str:
    """``0.4123 vs the base model's 0.4410 (LoRA gain 0.0287, 6.5%)``; a negative gain: the LoRA does worse."""
    gain = base - loss
    percent = f", {100.0 * gain / base:.1f}%" if base else ""
    return f"{loss:.4f} vs the base model's {base:.4f} (LoRA gain {gain:.4f}{percent})"


def validation_event(state: dict, took: str = "") -> str:
    """The terminal's line after a validation: ``validation at step 6: val_loss 0.4123 (2.1 s); base ...``; a
    validation that is not finite says that it is never the best LoRA, and which one stays."""
    line = f"validation at step {state['val_step']}: val_loss {state['val_loss']:.4f}{took}" + (
        ", new best" if state.get("new_best") else "")
    if finite_number(state["val_loss"]) is None:
        best = state.get("best")
        line += ", not finite: never the best LoRA (" + (
            f"{BEST_LORA} stays step {best['step']}'s)" if best else f"no {BEST_LORA} yet)")
    if state.get("val_loss_ema") is not None:
        line += f", EMA {state['val_loss_ema']:.4f}"
    line += standing_note(state)   # where the early stop's count stands
    base = state.get("val_loss_base")
    if base is not None:
        line += f"; base model {base:.4f}" + (" (measured now, once for the run)"
                                              if state.get("val_loss_base_step") == state["val_step"] else "")
    return line


def validation_lines(state: dict) -> list[str]:
    """``  validation: loss 0.4123 vs the base model's 0.4410 (LoRA gain 0.0287, 6.5%)`` (and the EMA's), when the
    run measured the base; else nothing."""
    base = state.get("val_loss_base")
    if base is None or state.get("val_loss") is None:
        return []
    which = " (EMA)" if state.get("val_weights") == "ema" else ""
    lines = [f"  validation: loss{which} {against_base(state['val_loss'], base)}"]
    if state.get("val_loss_ema") is not None:
        lines.append(f"  validation: EMA loss {against_base(state['val_loss_ema'], base)}")
    return lines


def written_files(output_path: str, run_id: str | None) -> list[Path]:
    """The LoRA files in ``output_path`` that this run wrote (their metadata names its run id), by name."""
    folder = Path(output_path)
    if not run_id or not folder.is_dir():
        return []
    return sorted(path for path in folder.iterdir() if LORA_FILE.match(path.name) and path.is_file()
                  and lora_file_owner(path) == run_id)


def numbered_text(names: list[str], kind: str) -> str:
    """``3 epoch files (epoch-001 .. epoch-003)`` for the ``kind`` files among ``names``, '' when none."""
    prefix = NUMBERED[kind]
    found = sorted((int(stem[len(prefix):]), stem) for name in names if (match := LORA_FILE.match(name))
                   and not match["ema"] and (stem := match["stem"]).startswith(prefix))
    if not found:
        return ""
    first, last = found[0][1], found[-1][1]
    return f"{len(found)} {kind} file(s) ({first}" + (f" .. {last})" if len(found) > 1 else ")")


def files_lines(output_path: str, run_id: str | None) -> list[str]:
    """The summary's lines for this run's files other than ``lora.safetensors``: its EMA twin, and how many epoch
    and step files (each with its ``_ema`` twin when the run keeps an EMA)."""
    names = [path.name for path in written_files(output_path, run_id)]
    final_twin = ema_twin_name(FINAL_LORA)
    lines = [f"  EMA LoRA: {output_path}/{final_twin}"] if final_twin in names else []
    numbered = [text for text in (numbered_text(names, kind) for kind in NUMBERED) if text]
    if numbered:
        twins = " (each with its _ema twin)" if any(LORA_FILE.match(name)["ema"] and name != final_twin
                                                    for name in names) else ""
        lines.append(f"  also in {output_path}: {', '.join(numbered)}{twins}")
    return lines


def replaced_media(per_rank: list[tuple[int, int, dict]]) -> dict:
    """The ranks' (samples seen, samples replaced, replaced rows: row -> [file, times]) as one record: the samples
    seen and replaced, how many rows, and the first REPLACED_ROWS_KEPT of them ([row, file, times], by row)."""
    rows: dict[int, list] = {}
    for _seen, _skipped, replaced in per_rank:
        for row, (file, times) in replaced.items():
            rows.setdefault(int(row), [int(row), file, 0])[2] += times
    ordered = [rows[row] for row in sorted(rows)]
    return {"samples": sum(skipped for _, skipped, _ in per_rank), "seen": sum(seen for seen, _, _ in per_rank),
            "row_count": len(ordered), "rows": ordered[:REPLACED_ROWS_KEPT]}


def replaced_lines(state: dict) -> list[str]:
    """``  replaced as bad media: 3 of 255 samples (1.2%), from 1 row: row 9 (media/photo.png) 3 times``; nothing
    when no file was replaced."""
    record = state.get("replaced_media") or {}
    if not record.get("samples"):
        return []
    samples, seen, count = record["samples"], record.get("seen") or 0, record.get("row_count") or 0
    share = f" ({100 * samples / seen:.1f}%)" if seen else ""
    named = ", ".join(f"row {row} ({file}) {times} time{'s' if times != 1 else ''}"
                      for row, file, times in record.get("rows", [])[:REPLACED_ROWS_SAID])
    more = f" and {count - REPLACED_ROWS_SAID:,} more" if count > REPLACED_ROWS_SAID else ""
    return [f"  replaced as bad media: {samples:,} of {seen:,} samples{share}, from {count:,} "
            f"row{'s' if count != 1 else ''}: {named}{more} (the last reasons: skip_reasons in each rank's status file)"]
