"""The run's recipe: the settings that change what is trained, as one record. Pure: no torch.

``recipe_of(options)`` picks them from the typed options (what each sample trains, its timesteps and loss weight,
the adapter, the EMA, the captions, the frames, the catalogues and their repeats): each option declared with a place in
the recipe (``recipe="lora.rank"``, ``training/options/run_options.py``) as it is, and what is worked out from several
(the timestep scheme, the alpha, the catalogues) here; the status file carries it once
as ``recipe`` and rank 0 prints it once at the start as ``recipe: ...`` lines (``recipe_lines``) beside the step
plan. Settings of how fast or where the run goes (precision, compile, checkpoints, logging) are not in it.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from diffsynth_mbc.training.options.run_options import DECLARATIONS

WIDTH = 80   # the printed recipe's lines, for an 80-column terminal


def timestep_sampling_of(options) -> dict:
    """The timestep scheme with the parameters it reads (``training/step/timestep_sampling.py``)."""
    scheme = {"method": options.timestep_sampling}
    if options.timestep_sampling == "shift":
        scheme["shift"] = options.timestep_shift
    elif options.timestep_sampling == "logit_normal":
        scheme.update(logit_mean=options.logit_mean, logit_std=options.logit_std)
    elif options.timestep_sampling == "sigmoid":
        scheme["sigmoid_scale"] = options.sigmoid_scale
    if options.timestep_strata != 1:
        scheme["strata"] = options.timestep_strata
    if (options.min_timestep_boundary, options.max_timestep_boundary) != (0.0, 1.0):
        scheme["boundaries"] = [options.min_timestep_boundary, options.max_timestep_boundary]
    return scheme


def catalogues_of(options) -> list[dict]:
    """Each catalogue: its name, metadata, repeat per epoch (its own x ``--dataset_repeat``), caption prefix and
    media; one catalogue (``--dataset_metadata_path``) is one item named after its folder."""
    if not options.datasets:
        path = Path(options.dataset_metadata_path or "")   # named as data/dataset_list.py names a catalogue
        return [{"name": path.parent.name or "dataset", "metadata_path": str(path), "repeat": options.dataset_repeat}]
    return [{"name": item.name, "metadata_path": item.metadata_path, "repeat": item.repeat * options.dataset_repeat,
             **({"caption_prefix": item.caption_prefix} if item.caption_prefix else {}),
             **({"media": item.media} if item.media != "all" else {})} for item in options.datasets]


def recipe_of(options) -> dict:
    """The settings of ``options`` (a ``TrainOptions``) that change what the LoRA learns."""
    recipe: dict = {}
    values = options.as_dict()
    for name, declaration in DECLARATIONS.items():
        if declaration.recipe:   # "lora.rank": recipe["lora"]["rank"]
            *within, key = declaration.recipe.split(".")
            place = recipe
            for part in within:
                place = place.setdefault(part, {})
            place[key] = declaration.recorded(values[name])
    recipe["timestep_sampling"] = timestep_sampling_of(options)
    recipe["lora"]["alpha"] = options.lora_rank if options.lora_alpha is None else options.lora_alpha
    if options.ema_decay is None:
        recipe["ema"] = None
    recipe["catalogues"] = catalogues_of(options)
    return recipe


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def recipe_text(recipe: dict) -> str:
    """The recipe in one paragraph: ``objective modes (videos i2v 100%) | 704x1280x17 | buckets off | ...``."""
    lora, captions, frames = recipe["lora"], recipe["captions"], recipe["frames"]
    timesteps = recipe["timestep_sampling"]
    scheme = " ".join([timesteps["method"]] + [f"{key} {_number(value)}" for key, value in timesteps.items()
                                                if key != "method"])
    adapter = f"{lora['variant']} rank {lora['rank']} alpha {_number(lora['alpha'])}" + (
        f" LoRA+ x{_number(lora['loraplus_lr_ratio'])}" if lora["loraplus_lr_ratio"] is not None else "") + (
        f" from {lora['init_lora']}" if lora["init_lora"] else "")
    ema = recipe["ema"]
    size = recipe["size"]
    videos = f" (videos i2v {100 * recipe['i2v_probability']:g}%)" if recipe["objective"] == "modes" else ""
    parts = [f"objective {recipe['objective']}{videos}",
             f"{size['height']}x{size['width']}x{size['num_frames']}", f"buckets {recipe['buckets']}",
             f"frames {frames['sampling']}" + (f" at {_number(frames['source_fps'])} fps" if frames["source_fps"]
                                               else "") + f", short clips {frames['short_clips']}",
             f"timesteps {scheme}", f"loss weighting {recipe['loss_weighting']}", adapter,
             f"lr {recipe['learning_rate']:.2e} {recipe['lr_scheduler']}",
             "no EMA" if ema is None else f"EMA {_number(ema['decay'])} (validate with {ema['validate_with']})",
             f"caption dropout {_number(captions['dropout'])}"
             + (f", prefix {captions['prefix']!r}" if captions["prefix"] else "")
             + (f", suffix {captions['suffix']!r}" if captions["suffix"] else ""),
             "catalogues " + ", ".join(f"{item['name']} x{item['repeat']}" for item in recipe["catalogues"])]
    return " | ".join(parts)


def recipe_lines(recipe: dict, width: int = WIDTH) -> list[str]:
    """``recipe_text`` in lines of at most ``width`` columns, broken between its fields (a field longer than a line
    between its words), the first line starting ``recipe: ``, the others indented."""
    lines, line = [], "recipe:"
    for field in recipe_text(recipe).split(" | "):
        joined = f"{line} {field}" if line.endswith(":") else f"{line} | {field}"
        if len(joined) <= width or line.endswith(":"):
            line = joined
        else:
            lines.append(line + " |")
            line = f"  {field}"
    lines.append(line)
    return [part for text in lines for part in (textwrap.wrap(text, width=width, subsequent_indent="  ",
                                                              break_on_hyphens=False) or [text])]


def announce_recipe(options, status, main: bool, stream=None) -> None:
    """The recipe into the status file (``recipe``, once at the start); on rank 0 (``main``) its lines on stderr."""
    recipe = recipe_of(options)
    status.update(recipe=recipe)
    if main:
        print("\n".join(recipe_lines(recipe)), file=stream or sys.stderr)
