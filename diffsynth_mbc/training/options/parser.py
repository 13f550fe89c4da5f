"""The command line of ``python -m diffsynth_mbc.train``: every flag, in groups, with its help. No torch."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from diffsynth_mbc.flags import FlagParser, unknown_flag_line
from diffsynth_mbc.training.options.checks import OPTIONAL_NUMBERS
from diffsynth_mbc.training.options.run_options import CHOICES as _CHOICES


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
    _let_none_clear(parser)
    return parser


# Files and folders a run may go without: ``none`` clears the preset's (the validation's catalogue and cache, the
# sample prompts, the latent cache, a LoRA to start from)
OPTIONAL_PATHS = frozenset(["val_metadata_path", "val_base_path", "val_cache", "cache", "sample_prompts",
                            "init_lora"])


def _let_none_clear(parser: argparse.ArgumentParser) -> None:
    """A number a run may leave unset (``--val_steps``, ``--checkpoint_minutes``, ...) or a file it may go without
    (``OPTIONAL_PATHS``) also takes ``none``: on the command line it clears what the preset set, as if the preset had
    not set it."""
    for action in parser._actions:
        if action.dest in OPTIONAL_NUMBERS or action.dest in OPTIONAL_PATHS:
            action.type = _or_none(action.type or str)
            action.help = f"{action.help} (none: unset, over a preset)"


def _validations_or_off(text):
    """``--early_stop``: a number of validations (1 or more), or off / none."""
    if str(text).strip().lower() in ("off", "none"):
        return None
    try:
        number = int(str(text).strip())
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a number of validations (1 or more) or off, got {text!r}")
    return number


def _or_none(parse):
    def or_none(text):
        return None if str(text).strip().lower() == "none" else parse(text)

    or_none.__name__ = parse.__name__   # errors still say "invalid int value", "cannot read ... as float"
    return or_none


def _add_frame_arguments(data) -> None:
    data.add_argument("--frame_sampling", help="which frames of a clip train: head (the first --num_frames; default), "
                                               "uniform (spread over the whole clip) or random_window (a stretch "
                                               "drawn anew each epoch; not from a latent cache)")
    data.add_argument("--source_fps", type=float, help="put every clip at this frame rate first (nearest frame), so "
                                                       "25 and 30 fps clips move at one speed (default: as recorded)")
    data.add_argument("--resolution_stages", help="train the first share of the optimizer steps at a lower "
                                                  "resolution: WxH[xF]:SHARE[,...], e.g. 832x480:0.7 (70%% of the steps "
                                                  "at 832x480's area, the rest at --width x --height); shares add up to "
                                                  "under 1; validation and sample clips stay at the final size")
    data.add_argument("--buckets", help="off: every sample resized to cover --height x --width and centre-cropped "
                                        "(a portrait clip keeps its middle third; default); aspect: each sample at "
                                        "the bucket nearest its own aspect, at about the same pixel area, every GPU "
                                        "on one bucket at a time (docs/training.md, Buckets)")
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
    optim.add_argument("--fp32_residual", choices=_CHOICES["fp32_residual"],
                       help="keep the DiT's time embedding, modulation and residual stream in fp32 while its matmuls "
                            "and attention run in fp16/bf16, as Wan2.2's reference computes (fp16 overflows past "
                            "65,504 otherwise): auto (default: on under fp16 and bf16, off under fp32), on, off "
                            "(DiffSynth's own forward)")
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
    objective = parser.add_argument_group("objective (docs/recipe/objective.md)")
    objective.add_argument("--objective",
                           help="modes (default): images train text-to-image, videos image-to-video with frame 0 out "
                                "of the loss or text-to-video; diffsynth: DiffSynth 1.1.8's objective bit for bit "
                                "(every sample conditioned on its first frame, frame 0 in the loss)")
    objective.add_argument("--i2v_probability", type=float,
                           help="the share of video samples trained image-to-video (conditioned on their first "
                                "frame), the rest text-to-video; decided per sample from --seed, rank and epoch "
                                "(default 1.0; 0.5 for a LoRA meant for text-to-video too)")


def _add_memory_and_speed_arguments(optim) -> None:
    optim.add_argument("--use_gradient_checkpointing", type=_parse_bool,
                       help="true/false (default true); false is --gradient_checkpointing none")
    optim.add_argument("--gradient_checkpointing",
                       help="all (every DiT block recomputes its activations in backward), none, N (the first N "
                            "of the 30 blocks recompute, the rest keep theirs), or auto: the fewest recomputed "
                            "blocks that fit under 90%% of the GPU's memory (the memory model; all "
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
    data_quality.add_argument("--health_steps", type=int,
                              help="LoRA health (update and gradient norms per DiT block, flags: still, exploding, "
                                   "nonfinite, overfitting) at step 0, every N optimizer steps and at the end "
                                   "(default 10, with --lora_variant dora 100: a DoRA record costs 15 times a LoRA's; "
                                   "0: off; docs/training.md, LoRA health)")
    samples = parser.add_argument_group("sample clips")
    samples.add_argument("--sample_prompts", help="YAML or JSON lines of prompts (prompt, optional image, seed, "
                                                  "height, width, num_frames, steps, cfg_scale, negative_prompt): "
                                                  "rank 0 renders them before the first step, every "
                                                  "--sample_steps and at the end, into OUTPUT_PATH/samples/")
    samples.add_argument("--sample_steps", type=int, help="render the sample prompts every N optimizer steps")
    samples.add_argument("--sample_strengths", type=str,
                         help="render each sample prompt at each of these LoRA strengths, same seed, e.g. 0,0.5,1 "
                              "(0: the base model, rendered once per prompt into samples/base/; default 1)")
    data_quality.add_argument("--early_stop", type=_validations_or_off,
                              help="stop (a checkpoint, status finished, exit 0) after N validations in a row "
                                   "without an improvement of --early_stop_min_delta; off (default) trains the "
                                   "planned total. The best LoRA is kept either way (lora-best.safetensors)")
    data_quality.add_argument("--early_stop_min_delta", type=float,
                              help="what counts as an improvement for --early_stop: at least this share below the "
                                   "loss the count was last reset at (default 0.001: 0.1%%)")
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


def check_launcher_args(argv: Sequence[str]) -> int:
    """``LAUNCHER LAUNCHER_FLAG... -- TRAINING_ARGS...``: the launchers' check, before anything is locked or
    started, that every flag they pass on is a training flag; 2 with one line naming the unknown one."""
    launcher, rest = argv[0], list(argv[1:])
    split = rest.index("--") if "--" in rest else len(rest)
    line = unknown_flag_line(rest[split + 1:], [build_parser()], also=rest[:split],
                             full_list=f"bash {launcher} --help")
    if line:
        print(f"error: {line}", file=sys.stderr)
        return 2
    return 0
