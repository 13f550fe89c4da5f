"""Options of ``python -m diffsynth_mbc.train``: defaults < preset file (--config) < command line. No torch.

Names follow DiffSynth's own training scripts where they overlap, so the users' flags carry over.
Unknown keys in a preset are rejected with the key and file named.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import yaml

from diffsynth_mbc.data.catalogues import apply_datasets
from diffsynth_mbc.data.caption_rules import check_caption_options
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.training.init_lora import check_init_lora_option
from diffsynth_mbc.training.ema import check_options as check_ema_options

DEFAULTS = {
    # data (DiffSynth names)
    "dataset_base_path": None, "dataset_metadata_path": None,
    "height": 704, "width": 1280, "num_frames": 17, "dataset_repeat": 1, "dataset_num_workers": 2,
    "datasets": None,   # several catalogues (data/catalogues.py); the three keys above are the one-catalogue form
    # model
    "model_dir": None, "model_id": None, "demo": False,
    # LoRA (DiffSynth names)
    "lora_rank": 32, "lora_alpha": None, "lora_format": "comfyui", "lora_target_modules": "q,k,v,o,ffn.0,ffn.2",
    "lora_variant": "lora", "loraplus_lr_ratio": None,
    "init_lora": None,
    # optimisation
    "learning_rate": 1e-4, "weight_decay": 0.01, "num_epochs": 1, "batch_size": 1,
    "gradient_accumulation_steps": 1, "lr_scheduler": "constant", "warmup_steps": 0,
    "max_grad_norm": 1.0, "seed": 42, "mixed_precision": "auto", "max_nonfinite_steps": 20,
    "use_gradient_checkpointing": True, "use_gradient_checkpointing_offload": False,
    "gradient_checkpointing": None, "compile": "auto", "image_batch_size": None,
    "max_timestep_boundary": 1.0, "min_timestep_boundary": 0.0, "find_unused_parameters": False,
    "timestep_sampling": "diffsynth", "timestep_shift": 5.0, "logit_mean": 0.0, "logit_std": 1.0,
    "sigmoid_scale": 1.0, "timestep_strata": 1, "loss_weighting": "diffsynth",
    # output and logging
    "output_path": "./runs/lora", "log_dir": None, "run_id": None, "save_steps": None,
    "status_interval_s": 5.0, "dist_backend": None,
    # checkpoints, resume, stopping
    "checkpoint_steps": None, "checkpoint_minutes": None, "keep_checkpoints": 3, "checkpoint_dir": None,
    "keep_old_histories": 3, "print_every_s": 30.0, "report_to": "none",
    "resume": None, "force_resume": False, "start_over": False, "stop_grace_s": 300.0, "allow_stale_cache": False,
    "decoder": "fast", "frame_sampling": "head", "source_fps": None, "short_clips": "shorten",
    # bad media and validation
    "max_bad_media_fraction": 0.01,
    "val_metadata_path": None, "val_base_path": None, "val_steps": None, "val_samples": 16,
    "val_timestep_quantiles": "0.1,0.3,0.5,0.7,0.9",
    # samples
    "sample_prompts": None, "sample_steps": None,
    # latent cache
    "cache": None, "val_cache": None,
    # captions
    "caption_dropout": 0.0, "caption_prefix": "", "caption_suffix": "",
    # EMA of the LoRA weights (training/ema.py)
    "ema_decay": None, "ema_warmup": True, "validate_with": "raw",
}

MAX_SIDE = 4096   # pixels, each of --height and --width
_BOOLEAN = {key for key, value in DEFAULTS.items() if isinstance(value, bool)}
_CHOICES = {"lr_scheduler": ("constant", "cosine"), "dist_backend": (None, "nccl", "gloo"),
            "lora_format": ("comfyui", "diffsynth"), "decoder": ("fast", "diffsynth"),
            "report_to": ("none", "tensorboard", "wandb"), "mixed_precision": ("auto", "bf16", "fp16", "fp32"),
            "compile": ("auto", "on", "off"), "frame_sampling": ("head", "uniform", "random_window"),
            "short_clips": ("shorten", "loop", "skip"),
            "timestep_sampling": ("diffsynth", "uniform", "shift", "logit_normal", "sigmoid"),
            "loss_weighting": ("diffsynth", "none"), "lora_variant": ("lora", "dora")}


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="python -m diffsynth_mbc.train", argument_default=argparse.SUPPRESS, allow_abbrev=False,
        description="LoRA fine-tuning of Wan2.2-TI2V-5B through DiffSynth. Start it with `accelerate launch`.",
        epilog="Example: accelerate launch --config_file configs/accelerate/ddp.yaml -m diffsynth_mbc.train "
               "--config configs/train_test.yaml --learning_rate 5e-5")
    parser.add_argument("--config", help="YAML preset (see configs/); flags given here override it")
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_base_path", help="folder the metadata paths are relative to")
    data.add_argument("--dataset_metadata_path", help="metadata.csv written by `python -m diffsynth_mbc.convert`")
    data.add_argument("--height", type=int, help="training height (multiple of 32; default 704)")
    data.add_argument("--width", type=int, help="training width (multiple of 32; default 1280)")
    data.add_argument("--num_frames", type=int, help="frames per clip, 4k+1 (default 17)")
    data.add_argument("--dataset_repeat", type=int, help="times each row is seen per epoch (default 1)")
    data.add_argument("--datasets", help="YAML file listing several catalogues (base_path, metadata_path, repeat, "
                                         "caption_prefix, media: video|image|all), trained as one; a preset may "
                                         "list them inline under datasets:")
    data.add_argument("--dataset_num_workers", type=int, help="data-loader worker processes per GPU (default 2)")
    data.add_argument("--cache", help="latent cache from `python -m diffsynth_mbc.cache`: train the DiT only "
                                      "(the VAE and text encoder are never loaded)")
    data.add_argument("--decoder", help="fast: decode only the frames that train, in-process (PyAV; default); "
                                        "diffsynth: DiffSynth's own reader (decodes whole clips to count frames)")
    _add_frame_arguments(data)
    data.add_argument("--allow_stale_cache", type=_parse_bool,
                      help="train from --cache even if media files changed since it was built (default false: "
                           "refused, naming the files)")
    data.add_argument("--val_cache", help="latent cache of --val_metadata_path (needed with --cache)")
    model = parser.add_argument_group("model")
    model.add_argument("--model_dir", help="local Wan2.2-TI2V-5B folder (DiT shards, T5, VAE, google/umt5-xxl)")
    model.add_argument("--model_id", help="ModelScope id to download instead (default Wan-AI/Wan2.2-TI2V-5B)")
    model.add_argument("--demo", action="store_true", help="tiny random model with the TI2V-5B architecture")
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--lora_rank", type=int, help="default 32")
    lora.add_argument("--lora_alpha", type=float, help="default: the rank")
    lora.add_argument("--lora_format", help="layout of the LoRA files: comfyui (diffusion_model.<module>.lora_A/B; "
                                            "default) or diffsynth (<module>.lora_A/B); both load in DiffSynth, "
                                            "alpha/rank is folded in")
    lora.add_argument("--lora_target_modules", help="default q,k,v,o,ffn.0,ffn.2")
    lora.add_argument("--lora_variant", help="lora (default) or dora: a learned magnitude per output row beside the "
                                             "low-rank direction (DoRA, through peft); needs --lora_format comfyui")
    lora.add_argument("--loraplus_lr_ratio", type=float,
                      help="LoRA+: the lora_B matrices learn at this many times --learning_rate (e.g. 16); "
                           "default: off, one learning rate for all")
    lora.add_argument("--init_lora", help="start the LoRA from this file (ours, ComfyUI or DiffSynth layout) or "
                                          "checkpoint folder, with a fresh optimizer at step 0; not with --resume")
    _add_optimisation_arguments(parser)
    out = parser.add_argument_group("output and logging")
    out.add_argument("--output_path", help="where the LoRA safetensors go (default ./runs/lora)")
    out.add_argument("--log_dir", help="per-rank training_gpu{rank}.json/.jsonl (default OUTPUT_PATH/training_logs, "
                                       "so two runs never share one by default)")
    out.add_argument("--run_id", help="names this run in the logs (default: time-based)")
    out.add_argument("--save_steps", type=int, help="also save the LoRA every N optimizer steps")
    out.add_argument("--status_interval_s", type=float, help="at most one status rewrite per N s (default 5)")
    out.add_argument("--dist_backend", choices=("nccl", "gloo"), help="default: nccl on GPUs, gloo on CPU")
    out.add_argument("--report_to", help="none (default), tensorboard (pip install -e '.[tensorboard]'; event "
                                          "files in OUTPUT_PATH/tracking/RUN_ID) or wandb, through accelerate's "
                                          "trackers: the JSONL's scalars every optimizer step, from rank 0")
    out.add_argument("--print_every_s", type=float, help="without a terminal, rank 0 prints a progress line this "
                                                         "often and at every epoch end (default 30)")
    out.add_argument("--keep_old_histories", type=int, help="a new run sets the previous history aside as "
                                                            "*.jsonl.old; keep the newest N of them (default 3)")
    _add_checkpoint_and_quality_arguments(parser)
    _add_caption_arguments(parser)
    _add_ema_arguments(parser)
    return parser


def _add_frame_arguments(data) -> None:
    data.add_argument("--frame_sampling", help="which frames of a clip train: head (the first --num_frames; default), "
                                               "uniform (spread over the whole clip) or random_window (a stretch "
                                               "drawn anew each epoch; not from a latent cache)")
    data.add_argument("--source_fps", type=float, help="put every clip at this frame rate first (nearest frame), so "
                                                       "25 and 30 fps clips move at one speed (default: as recorded)")
    data.add_argument("--short_clips", help="a clip with fewer frames than --num_frames: shorten (its longest 4k+1 "
                                            "leading frames; default), loop (from its start again) or skip (bad "
                                            "media: replaced by the next row and counted)")


def _add_caption_arguments(parser: argparse.ArgumentParser) -> None:
    captions = parser.add_argument_group("captions")
    captions.add_argument("--caption_dropout", type=float,
                          help="train on the empty prompt instead of the caption with this probability, decided per "
                               "sample from --seed, rank and epoch (default 0: never)")
    captions.add_argument("--caption_prefix", help="text put before every caption, with one space (a trigger word; "
                                                   "default none); a latent cache must be built with the same")
    captions.add_argument("--caption_suffix", help="text put after every caption, with one space (default none); a "
                                                   "latent cache must be built with the same")


def _add_ema_arguments(parser: argparse.ArgumentParser) -> None:
    ema = parser.add_argument_group("EMA of the LoRA weights")
    ema.add_argument("--ema_decay", type=float,
                     help="keep an fp32 exponential moving average of the LoRA with this decay (e.g. 0.999), "
                          "written as <name>_ema.safetensors beside every LoRA file and kept in checkpoints "
                          "(default: none)")
    ema.add_argument("--ema_warmup", type=_parse_bool,
                     help="true (default): update n uses min(decay, (1 + n) / (10 + n)), so the EMA follows the "
                          "weights at first; false: the decay from the first update")
    ema.add_argument("--validate_with", help="weights of validation loss and sample clips: raw (default), ema, or "
                                             "both (the EMA's as val_loss_ema and *-ema clips)")


def _add_optimisation_arguments(parser: argparse.ArgumentParser) -> None:
    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--learning_rate", type=float, help="default 1e-4")
    optim.add_argument("--weight_decay", type=float, help="default 0.01")
    optim.add_argument("--num_epochs", type=int, help="default 1")
    optim.add_argument("--batch_size", type=int, help="videos per GPU per micro-batch, in one forward (default 1)")
    optim.add_argument("--image_batch_size", type=int,
                       help="images per GPU per micro-batch, in one forward (default: as many images as "
                            "--batch_size videos have tokens, 5 at 1280x704x17)")
    optim.add_argument("--gradient_accumulation_steps", type=int, help="default 1")
    optim.add_argument("--lr_scheduler", choices=_CHOICES["lr_scheduler"], help="default constant")
    optim.add_argument("--warmup_steps", type=int, help="linear warm-up, optimizer steps (default 0)")
    optim.add_argument("--max_grad_norm", type=float, help="gradient clipping; 0 disables (default 1.0)")
    optim.add_argument("--seed", type=int, help="base seed; each rank draws noise from seed + rank (default 42)")
    optim.add_argument("--mixed_precision", choices=_CHOICES["mixed_precision"],
                       help="auto (default): bf16 where the GPU has it natively (sm80+), fp16 with dynamic loss "
                            "scaling otherwise (V100); fp32 on the CPU")
    optim.add_argument("--max_nonfinite_steps", type=int,
                       help="a step with an inf/NaN loss or gradient norm is skipped and counted; this many in a "
                            "row stop the run (default 20)")
    _add_memory_and_speed_arguments(optim)
    optim.add_argument("--max_timestep_boundary", type=float)
    optim.add_argument("--min_timestep_boundary", type=float)
    optim.add_argument("--find_unused_parameters", type=_parse_bool)
    _add_timestep_arguments(parser)


def _add_timestep_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("timesteps (docs/recipe/timestep-sampling.md)")
    group.add_argument("--timestep_sampling",
                       help="how each sample's noise level is drawn: diffsynth (default: DiffSynth's own draw, a "
                            "uniform index of its shift-5 schedule), uniform, shift, logit_normal, sigmoid; "
                            "--min/max_timestep_boundary rescale the distribution into their range")
    group.add_argument("--timestep_shift", type=float, help="S of --timestep_sampling shift (default 5.0)")
    group.add_argument("--logit_mean", type=float, help="mean of --timestep_sampling logit_normal (default 0.0)")
    group.add_argument("--logit_std", type=float, help="std of --timestep_sampling logit_normal (default 1.0)")
    group.add_argument("--sigmoid_scale", type=float, help="scale of --timestep_sampling sigmoid (default 1.0)")
    group.add_argument("--timestep_strata", type=int,
                       help="N > 1: every N draws of a rank take one from each of N equal parts of the "
                            "distribution (stratified; default 1: independent draws)")
    group.add_argument("--loss_weighting", help="diffsynth (default: DiffSynth's per-timestep weight) or none")


def _add_memory_and_speed_arguments(optim) -> None:
    optim.add_argument("--use_gradient_checkpointing", type=_parse_bool,
                       help="true/false (default true); false is --gradient_checkpointing none")
    optim.add_argument("--gradient_checkpointing",
                       help="all (every DiT block recomputes its activations in backward), none, N (the first N "
                            "of the 30 blocks recompute, the rest keep theirs), or auto: the fewest recomputed "
                            "blocks that fit under 90%% of the GPU's memory (the doctor's memory model; all "
                            "without a GPU). Default: all, or none with --use_gradient_checkpointing false")
    optim.add_argument("--compile", choices=_CHOICES["compile"],
                       help="torch.compile each DiT block: auto (default: on CUDA GPUs where torch can compile "
                            "for them, off on the CPU), on, off")
    optim.add_argument("--use_gradient_checkpointing_offload", type=_parse_bool, help="true/false")


def _add_checkpoint_and_quality_arguments(parser: argparse.ArgumentParser) -> None:
    ckpt = parser.add_argument_group("checkpoints, resume and stopping")
    ckpt.add_argument("--checkpoint_steps", type=int, help="full training state every N optimizer steps")
    ckpt.add_argument("--checkpoint_minutes", type=float, help="... and/or every M minutes, whichever comes first")
    ckpt.add_argument("--keep_checkpoints", type=int, help="keep the newest K (default 3) plus any with a KEEP file")
    ckpt.add_argument("--checkpoint_dir", help="default: OUTPUT_PATH/checkpoints (shared by all nodes)")
    ckpt.add_argument("--resume", help="'latest' or a checkpoint folder: continue at its exact step and data position")
    ckpt.add_argument("--force_resume", type=_parse_bool, help="resume even if the configuration differs")
    ckpt.add_argument("--start_over", type=_parse_bool,
                      help="a fresh run in a checkpoint folder holding another run's checkpoints: move them "
                           "into CHECKPOINT_DIR/replaced-RUN_ID/ and start (default false: refused, naming them)")
    ckpt.add_argument("--stop_grace_s", type=float,
                      help="after Ctrl-C/SIGTERM, how long ranks may take to finish the step and save (default 300)")
    data_quality = parser.add_argument_group("bad media and validation")
    data_quality.add_argument("--max_bad_media_fraction", type=float,
                              help="stop when more than this share of samples (and over 10) fail to decode "
                                   "(default 0.01); each bad one is replaced by the next row and reported")
    data_quality.add_argument("--val_metadata_path", help="metadata_val.csv for validation loss")
    data_quality.add_argument("--val_base_path", help="default: --dataset_base_path")
    data_quality.add_argument("--val_steps", type=int, help="validation loss every N optimizer steps (and at the end)")
    data_quality.add_argument("--val_samples", type=int, help="fixed validation subset size (default 16)")
    samples = parser.add_argument_group("sample clips")
    samples.add_argument("--sample_prompts", help="YAML or JSON lines of prompts (prompt, optional image, seed, "
                                                  "height, width, num_frames, steps, cfg_scale, negative_prompt): "
                                                  "rank 0 renders them before the first step, every "
                                                  "--sample_steps and at the end, into OUTPUT_PATH/samples/")
    samples.add_argument("--sample_steps", type=int, help="render the sample prompts every N optimizer steps")
    data_quality.add_argument("--val_timestep_quantiles",
                              help="validation loss at these fixed points of the noise schedule, comma-separated "
                                   "in (0, 1); the headline val_loss is their mean (default 0.1,0.3,0.5,0.7,0.9)")


def _parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def load_preset(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise OptionsError(f"--config: file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise OptionsError(f"--config: {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise OptionsError(f"--config: {path} must hold a mapping of option: value")
    unknown = sorted(set(data) - set(DEFAULTS))
    if unknown:
        raise OptionsError(f"--config: unknown key(s) in {path}: {', '.join(unknown)}")
    types = {action.dest: action.type for action in build_parser()._actions if action.type is not None}
    for key, value in data.items():
        if value is not None and key in types and not isinstance(value, bool):
            try:
                data[key] = types[key](value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                raise OptionsError(f"--config: {path}: {key}: cannot read {value!r} as "
                                   f"{getattr(types[key], '__name__', 'a value')}") from None
    return data


def resolve_options(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, merge and validate. Raises OptionsError (or SystemExit for argparse usage errors)."""
    given = vars(build_parser().parse_args(argv))
    preset = load_preset(given.pop("config")) if "config" in given else {}
    options = {**DEFAULTS, **preset, **given}
    for key in _BOOLEAN:
        if not isinstance(options[key], bool):
            options[key] = _parse_bool(options[key])
    if options["gradient_checkpointing"] is None:
        options["gradient_checkpointing"] = "all" if options["use_gradient_checkpointing"] else "none"
    options["gradient_checkpointing"] = str(options["gradient_checkpointing"]).strip().lower()
    apply_datasets(options, preset, given)
    validate(options)
    # Each run's own folders by default: runs that share a log or checkpoint folder corrupt each other.
    if not options["log_dir"]:
        options["log_dir"] = str(Path(options["output_path"]) / "training_logs")
    if not options["checkpoint_dir"]:
        options["checkpoint_dir"] = str(Path(options["output_path"]) / "checkpoints")
    return argparse.Namespace(**options)


# Every number the training reads, checked here and nowhere else: (lowest, highest, lowest allowed?, highest allowed?).
# NaN and infinity are refused for every float: a NaN learning rate or alpha trains "fine" and writes a NaN LoRA.
_INTEGERS = {   # key: (lowest, optional)
    "height": (1, False), "width": (1, False), "num_frames": (1, False), "dataset_repeat": (1, False),
    "lora_rank": (1, False), "num_epochs": (1, False), "batch_size": (1, False),
    "gradient_accumulation_steps": (1, False), "max_nonfinite_steps": (1, False), "keep_checkpoints": (1, False),
    "val_samples": (1, False), "dataset_num_workers": (0, False), "warmup_steps": (0, False),
    "keep_old_histories": (0, False), "seed": (0, False), "image_batch_size": (1, True), "save_steps": (1, True),
    "checkpoint_steps": (1, True), "val_steps": (1, True), "sample_steps": (1, True), "timestep_strata": (1, False),
}
_FLOATS = {     # key: (low, high, low included, optional)
    "learning_rate": (0.0, None, False, False), "lora_alpha": (0.0, None, False, True),
    "weight_decay": (0.0, None, True, False), "max_grad_norm": (0.0, None, True, False),
    "status_interval_s": (0.0, None, False, False), "print_every_s": (0.0, None, False, False),
    "stop_grace_s": (0.0, None, False, False), "checkpoint_minutes": (0.0, None, False, True),
    "max_bad_media_fraction": (0.0, 1.0, True, False), "source_fps": (0.0, None, False, True),
    "min_timestep_boundary": (0.0, 1.0, True, False), "max_timestep_boundary": (0.0, 1.0, True, False),
    "timestep_shift": (0.0, None, False, False), "logit_mean": (-math.inf, None, False, False),
    "logit_std": (0.0, None, False, False), "sigmoid_scale": (0.0, None, False, False),
    "caption_dropout": (0.0, 1.0, True, False),
    "loraplus_lr_ratio": (0.0, None, False, True),
}
# Parameters of one --timestep_sampling scheme: given with another scheme they would do nothing, so they are refused.
_SCHEME_PARAMETERS = {"timestep_shift": "shift", "logit_mean": "logit_normal", "logit_std": "logit_normal",
                      "sigmoid_scale": "sigmoid"}
# A run id names files and folders (checkpoint temp folders, tracker runs, log lines): one plain name.
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TARGET_MODULE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")


# --report_to: the packages accelerate starts each tracker with (any one of them) and how to install them. A tracker
# accelerate cannot start is dropped with one warning in the log and the run trains on untracked: refused instead.
TRACKER_PACKAGES = {"tensorboard": (("tensorboard", "tensorboardX"), "pip install -e '.[tensorboard]'"),
                    "wandb": (("wandb",), "pip install wandb")}


def check_tracker(name: str) -> None:
    """The --report_to tracker's package is installed (looked up, not imported: no torch here)."""
    import importlib.util

    if name not in TRACKER_PACKAGES:
        return
    packages, install = TRACKER_PACKAGES[name]
    if not any(importlib.util.find_spec(package) is not None for package in packages):
        raise OptionsError(f"--report_to {name} needs the {packages[0]} package, which is not installed here: "
                           f"{install} (or leave --report_to out)")


def check_run_id(value, source: str = "--run_id") -> None:
    """A run id is one plain name: letters, digits, '.', '_', '-', starting with a letter or digit."""
    if not isinstance(value, str) or not _RUN_ID.match(value):
        raise OptionsError(f"{source} must be one plain name (letters, digits, '.', '_', '-', starting with a letter "
                           f"or digit, at most 128 characters; no '/' or '..'), got {value!r}")


def _check_numbers(options: dict) -> None:
    for key, (lowest, optional) in _INTEGERS.items():
        value = options[key]
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            what = "a positive integer" if lowest == 1 else "an integer of 0 or more"
            raise OptionsError(f"--{key} must be {what}, got {value!r}")
    for key, (low, high, low_included, optional) in _FLOATS.items():
        value = options[key]
        if value is None and optional:
            continue
        finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not finite or value < low or (value == low and not low_included) or (high is not None and value > high):
            bound = f"{'at least' if low_included else 'above'} {low:g}"
            if high is not None:
                bound = f"between {low:g} and {high:g}"
            raise OptionsError(f"--{key} must be a finite number {bound}, got {value!r}")
    steps = 1000   # DiffSynth's training schedule: a timestep is drawn from [int(min * 1000), int(max * 1000))
    if int(options["min_timestep_boundary"] * steps) >= int(options["max_timestep_boundary"] * steps):
        raise OptionsError(f"--min_timestep_boundary ({options['min_timestep_boundary']:g}) must be below "
                           f"--max_timestep_boundary ({options['max_timestep_boundary']:g}) by at least 1/{steps}, "
                           "so there is a timestep to draw")


def _check_names(options: dict) -> None:
    if options["run_id"] is not None:
        check_run_id(options["run_id"])
    targets = options["lora_target_modules"]
    if not isinstance(targets, str) or not all(_TARGET_MODULE.match(name) for name in targets.split(",")):
        raise OptionsError(f"--lora_target_modules must be a comma-separated list of module names (q,k,v,o,ffn.0, "
                           f"...), got {targets!r}")
    for key, allowed in _CHOICES.items():
        if options[key] not in allowed:
            raise OptionsError(f"--{key} must be one of {', '.join(str(a) for a in allowed if a)}, got {options[key]!r}")
    for key in ("output_path", "log_dir", "checkpoint_dir"):
        if options[key] and Path(options[key]).exists() and not Path(options[key]).is_dir():
            raise OptionsError(f"--{key} {options[key]} is a file, not a folder")
    check_tracker(options["report_to"])
    caption_problem = check_caption_options(options)
    if caption_problem:
        raise OptionsError(caption_problem)
    checkpointing = options["gradient_checkpointing"]
    if checkpointing not in ("all", "none", "auto") and not (checkpointing.isdigit()):
        raise OptionsError("--gradient_checkpointing must be all, none, auto or a number of blocks, got "
                           f"{checkpointing!r}")


def check_frame_options(options: dict) -> None:
    """A random window is drawn anew every epoch: no latent cache can hold it."""
    if options["frame_sampling"] == "random_window":
        for key in ("cache", "val_cache"):
            if options[key]:
                raise OptionsError(f"--frame_sampling random_window cannot train from --{key} {options[key]}: its "
                                   "frames are drawn anew every epoch, and a latent cache holds one set of frames per "
                                   "clip; use head or uniform with a cache, or train from the media files")


def _check_timestep_parameters(options: dict) -> None:
    for key, scheme in _SCHEME_PARAMETERS.items():
        if options[key] != DEFAULTS[key] and options["timestep_sampling"] != scheme:
            raise OptionsError(f"--{key} {options[key]:g} applies to --timestep_sampling {scheme} only, and this run "
                               f"uses --timestep_sampling {options['timestep_sampling']}")


def validate(options: dict) -> None:
    """Every option checked once, here; OptionsError names the flag and the value."""
    _check_numbers(options)
    _check_names(options)
    _check_timestep_parameters(options)
    for key in ("height", "width"):
        if options[key] > MAX_SIDE:
            raise OptionsError(f"--{key} {options[key]} is above {MAX_SIDE}, the largest side this trains "
                               "(Wan2.2-TI2V-5B was trained at 1280x704)")
        if options[key] % 32:
            raise OptionsError(f"--{key} must be a multiple of 32 (Wan2.2 VAE x DiT patch), got {options[key]}")
    if options["num_frames"] % 4 != 1:
        raise OptionsError(f"--num_frames must be 4k+1 (1, 5, 9, 13, 17, ...), got {options['num_frames']}")
    if not options["dataset_metadata_path"]:
        raise OptionsError("--dataset_metadata_path is required (metadata.csv from `python -m diffsynth_mbc.convert`)")
    if options["dataset_base_path"] is None:
        raise OptionsError("--dataset_base_path is required (the folder metadata paths are relative to)")
    try:
        quantiles = [float(q) for q in str(options["val_timestep_quantiles"]).split(",")]
    except ValueError:
        quantiles = []
    if not quantiles or not all(0 <= q < 1 for q in quantiles):
        raise OptionsError("--val_timestep_quantiles must be comma-separated numbers in [0, 1), got "
                           f"{options['val_timestep_quantiles']!r}")
    if options["sample_steps"] is not None and not options["sample_prompts"]:
        raise OptionsError("--sample_steps needs a positive number and --sample_prompts FILE")
    if options["val_steps"] and not options["val_metadata_path"]:
        raise OptionsError("--val_steps needs --val_metadata_path (metadata_val.csv from the converter)")
    check_frame_options(options)
    if options["lora_variant"] == "dora" and options["lora_format"] != "comfyui":
        raise OptionsError("--lora_variant dora needs --lora_format comfyui: DiffSynth's LoRA loader reads no DoRA "
                           f"magnitudes, so a {options['lora_format']} file would load at the wrong strength")
    check_init_lora_option(options)
    check_ema_options(options)
    if options["demo"] and (options["model_dir"] or options["model_id"]):
        raise OptionsError("--demo builds a tiny random model; do not combine it with --model_dir/--model_id")
