"""The options a training run carries from its first line to its last: one typed, read-only object, each option
declared once.

``TrainOptions`` declares every option (DiffSynth's names where they overlap, so the users' flags carry over) with
``option`` (``declaration.py``): its group in ``--help``, default, help, parse type, range or choices, whether
``none`` clears a preset's value, and its kinds: a path the run reads or writes, a plain key of the checkpoint
fingerprint, where the recipe panel shows it. The command line, the checks, the run's record, the fingerprint and the
recipe come from ``DECLARATIONS``. The list options hold their values parsed once (``ListValue``: the stages, the
quantiles, the strengths and the target modules, each with the text it was given as). ``resolve_options``
(``options/__init__.py``) builds it from the defaults, a preset and the command line, once, after every check in
``options/checks.py``. No torch.
"""

from __future__ import annotations

import dataclasses

from diffsynth_mbc.data.media.stages import parse_stages
from diffsynth_mbc.gpu import PRECISIONS
from diffsynth_mbc.models.model_files import MODELSCOPE_ID
from diffsynth_mbc.run_layout import (BEST_LORA, LORA_SUFFIX, OLD_HISTORY_SUFFIX, STATUS_FILE, ema_twin_name,
                                      replaced_folder_name)
from diffsynth_mbc.sample_prompts import parse_strengths
from diffsynth_mbc.training.lora.ema import WEIGHTS
from diffsynth_mbc.training.options.declaration import (CAPTIONS, CHECKPOINTS, DATA, EMA, LORA, MODEL, OBJECTIVE,
                                                        OPTIMISATION, OUTPUT, SAMPLES, TIMESTEPS, VALIDATION, ListValue,
                                                        declared, option)
from diffsynth_mbc.training.options.flag_values import module_names, parse_bool, quantiles, validations_or_off
from diffsynth_mbc.training.plan.evaluation_cost import HEALTH_STEPS
from diffsynth_mbc.training.plan.residual_policy import CHOICES as RESIDUAL_CHOICES

REQUIRED = "required, unless --datasets lists the catalogues"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
    # data (DiffSynth's names)
    dataset_base_path: str | None = option(DATA, None, "folder the metadata paths are relative to", path=True,
                                           unset=REQUIRED)
    dataset_metadata_path: str | None = option(DATA, None, "metadata.csv written by `python -m diffsynth_mbc.convert`",
                                               path=True, unset=REQUIRED)
    height: int = option(DATA, 704, "training height, a multiple of 32", parse=int, at_least=1, fingerprint=True,
                         recipe="size.height", sample=True)
    width: int = option(DATA, 1280, "training width, a multiple of 32", parse=int, at_least=1, fingerprint=True,
                        recipe="size.width", sample=True)
    num_frames: int = option(DATA, 17, "frames per clip, 4k+1", parse=int, at_least=1, fingerprint=True,
                             recipe="size.num_frames", sample=True)
    dataset_repeat: int = option(DATA, 1, "times each row is seen per epoch", parse=int, at_least=1, fingerprint=True)
    # several catalogues (data/dataset_list.py: Catalogue items once resolved)
    datasets: list | None = option(DATA, None, "YAML file listing several catalogues (base_path, metadata_path, "
                                   "repeat, caption_prefix, media: video|image|all), trained as one; a preset may list "
                                   "them inline, under datasets", unset="one catalogue, --dataset_base_path and "
                                   "--dataset_metadata_path")
    dataset_num_workers: int = option(DATA, 2, "data-loader worker processes per GPU", parse=int, at_least=0)
    cache: str | None = option(DATA, None, "latent cache from `python -m diffsynth_mbc.cache`: train the DiT only (the "
                               "VAE and text encoder are never loaded)", path=True, optional=True,
                               unset="none, the media files")
    decoder: str = option(DATA, "fast", "fast: decode only the frames that train, in-process (PyAV); diffsynth: "
                          "DiffSynth's own reader (decodes whole clips to count frames)", choices=("fast", "diffsynth"))
    frame_sampling: str = option(DATA, "head", "which frames of a clip train: head (the first --num_frames), uniform "
                                 "(spread over the whole clip) or random_window (a stretch drawn anew each epoch; not "
                                 "from a latent cache)", choices=("head", "uniform", "random_window"),
                                 recipe="frames.sampling")
    source_fps: float | None = option(DATA, None, "put every clip at this frame rate first (nearest frame), so 25 and "
                                      "30 fps clips move at one speed", parse=float, above=0.0, optional=True,
                                      unset="as recorded", recipe="frames.source_fps")
    resolution_stages: tuple = option(DATA, None, "train the first share of the optimizer steps at a lower resolution: "
                                      "WxH[xF]:SHARE[,...], e.g. 832x480:0.7 (70% of the steps at 832x480's area, the "
                                      "rest at --width x --height); shares add up to under 1; validation and sample "
                                      "clips stay at the final size", listed=parse_stages, fingerprint=True,
                                      unset="none, every step at --width x --height")
    buckets: str = option(DATA, "off", "off: every sample resized to cover --height x --width and centre-cropped (a "
                          "portrait clip keeps its middle third); aspect: each sample at the bucket nearest its own "
                          "aspect, at about the same pixel area, every GPU on one bucket at a time (docs/training.md, "
                          "Buckets)", choices=("off", "aspect"), fingerprint=True, recipe="buckets")
    short_clips: str = option(DATA, "shorten", "a clip with fewer frames than --num_frames: shorten (its longest 4k+1 "
                              "leading frames), loop (from its start again) or skip (bad media: replaced by the next "
                              "row and counted)", choices=("shorten", "loop", "skip"), recipe="frames.short_clips")
    allow_stale_cache: bool = option(DATA, False, "train from --cache even if media files changed since it was built "
                                     "(false: refused, naming the files)", parse=parse_bool)
    val_cache: str | None = option(DATA, None, "latent cache of --val_metadata_path (needed with --cache)", path=True,
                                   optional=True, unset="none, validation from the media files")
    # model
    model_dir: str | None = option(MODEL, None, "local Wan2.2-TI2V-5B folder (DiT shards, T5, VAE, google/umt5-xxl)",
                                   path=True, unset="none, the download of --model_id", sample=True)
    model_id: str | None = option(MODEL, None, "ModelScope id to download instead", unset=MODELSCOPE_ID, sample=True)
    demo: bool = option(MODEL, False, "tiny random model with the TI2V-5B architecture", parse=parse_bool,
                        switch=True, sample=True)
    # LoRA (DiffSynth's names)
    lora_rank: int = option(LORA, 32, "the rank of each LoRA pair", parse=int, at_least=1, fingerprint=True,
                            recipe="lora.rank")
    lora_alpha: float | None = option(LORA, None, "the LoRA's update is scaled by alpha / rank", parse=float,
                                      above=0.0, optional=True, unset="the rank", fingerprint=True)
    lora_format: str = option(LORA, "comfyui", "layout of the LoRA files: comfyui (diffusion_model.<module>.lora_A/B) "
                              "or diffsynth (<module>.lora_A/B); both load in DiffSynth, alpha/rank is folded in",
                              choices=("comfyui", "diffsynth"))
    lora_target_modules: tuple = option(LORA, "q,k,v,o,ffn.0,ffn.2", "comma-separated names of the Linear layers of "
                                        "every DiT block that get a LoRA", listed=module_names, fingerprint=True,
                                        recipe="lora.target_modules")
    lora_variant: str = option(LORA, "lora", "lora or dora: a learned magnitude per output row beside the low-rank "
                               "direction (DoRA, through peft); dora needs --lora_format comfyui",
                               choices=("lora", "dora"), fingerprint=True, recipe="lora.variant")
    loraplus_lr_ratio: float | None = option(LORA, None, "LoRA+: the lora_B matrices learn at this many times "
                                             "--learning_rate (e.g. 16)", parse=float, above=0.0, optional=True,
                                             unset="off, one learning rate for all", fingerprint=True,
                                             recipe="lora.loraplus_lr_ratio")
    init_lora: str | None = option(LORA, None, "start the LoRA from this file (ours, ComfyUI or DiffSynth layout) or "
                                   "checkpoint folder, with a fresh optimizer at step 0; not with --resume", path=True,
                                   optional=True, unset="none, a new LoRA", recipe="lora.init_lora")
    # optimisation
    learning_rate: float = option(OPTIMISATION, 1e-4, "AdamW's learning rate after the warm-up", parse=float,
                                  above=0.0, fingerprint=True, recipe="learning_rate")
    weight_decay: float = option(OPTIMISATION, 0.01, "AdamW's weight decay", parse=float, at_least=0.0,
                                 fingerprint=True)
    num_epochs: int = option(OPTIMISATION, 1, "passes over the catalogue", parse=int, at_least=1, fingerprint=True)
    batch_size: int = option(OPTIMISATION, 1, "videos per GPU per micro-batch, in one forward", parse=int, at_least=1,
                             fingerprint=True)
    image_batch_size: int | None = option(OPTIMISATION, None, "images per GPU per micro-batch, in one forward",
                                          parse=int, at_least=1, optional=True, unset="as many images as --batch_size "
                                          "videos have tokens, 5 at 1280x704x17")
    gradient_accumulation_steps: int = option(OPTIMISATION, 1, "micro-batches per optimizer step", parse=int,
                                              at_least=1)
    lr_scheduler: str = option(OPTIMISATION, "constant", "the learning rate after the warm-up: constant, or cosine "
                               "down to 0 at the last step", choices=("constant", "cosine"), fingerprint=True,
                               recipe="lr_scheduler")
    warmup_steps: int = option(OPTIMISATION, 0, "linear warm-up, optimizer steps", parse=int, at_least=0,
                               fingerprint=True)
    max_grad_norm: float = option(OPTIMISATION, 1.0, "gradient clipping; 0 disables", parse=float, at_least=0.0,
                                  fingerprint=True)
    seed: int = option(OPTIMISATION, 42, "base seed; each rank draws noise from seed + rank", parse=int, at_least=0,
                       fingerprint=True, sample=True)
    mixed_precision: str = option(OPTIMISATION, "auto", "auto: bf16 where the GPU has it natively (sm80+), fp16 with "
                                  "dynamic loss scaling otherwise (V100); fp32 on the CPU", choices=PRECISIONS,
                                  sample=True)
    max_nonfinite_steps: int = option(OPTIMISATION, 20, "a step with an inf/NaN loss or gradient norm is skipped and "
                                      "counted; this many in a row stop the run", parse=int, at_least=1)
    use_gradient_checkpointing: bool = option(OPTIMISATION, True, "true/false; false is --gradient_checkpointing none",
                                              parse=parse_bool)
    gradient_checkpointing: str | None = option(
        OPTIMISATION, None, "all (every DiT block recomputes its activations in backward), none, N (the first N of "
        "the 30 blocks recompute, the rest keep theirs), or auto: the fewest recomputed blocks that fit under 90% of "
        "the GPU's memory (the memory model; all without a GPU)",
        unset="all, or none with --use_gradient_checkpointing false")
    compile: str = option(OPTIMISATION, "auto", "torch.compile each DiT block: auto (on CUDA GPUs where torch can "
                          "compile for them, off on the CPU), on, off", choices=("auto", "on", "off"))
    fp32_residual: str = option(OPTIMISATION, "auto", "keep the DiT's time embedding, modulation and residual stream "
                                "in fp32 while its matmuls and attention run in fp16/bf16, as Wan2.2's reference does "
                                "(fp16's residual stream overflows at 65,504 otherwise): auto (on under fp16 and bf16, "
                                "off under fp32), on, off (DiffSynth's forward as it is)", choices=RESIDUAL_CHOICES)
    use_gradient_checkpointing_offload: bool = option(OPTIMISATION, False, "true: the recomputed blocks' inputs wait "
                                                      "in CPU memory (DiffSynth's offload)", parse=parse_bool)
    max_timestep_boundary: float = option(OPTIMISATION, 1.0, "the highest noise level trained, as a share of "
                                          "DiffSynth's 1000-step schedule", parse=float, at_least=0.0, at_most=1.0)
    min_timestep_boundary: float = option(OPTIMISATION, 0.0, "the lowest noise level trained, as a share of "
                                          "DiffSynth's 1000-step schedule", parse=float, at_least=0.0, at_most=1.0)
    find_unused_parameters: bool = option(OPTIMISATION, False, "DDP's find_unused_parameters: true looks for "
                                          "parameters without a gradient after every backward (slower)",
                                          parse=parse_bool)
    # timesteps (docs/recipe/timestep-sampling.md)
    timestep_sampling: str = option(TIMESTEPS, "diffsynth", "how each sample's noise level is drawn: diffsynth "
                                    "(DiffSynth's own draw, a uniform index of its shift-5 schedule), uniform, shift, "
                                    "logit_normal, sigmoid; --min/max_timestep_boundary rescale the distribution into "
                                    "their range", choices=("diffsynth", "uniform", "shift", "logit_normal", "sigmoid"))
    timestep_shift: float = option(TIMESTEPS, 5.0, "S of --timestep_sampling shift", parse=float, above=0.0)
    logit_mean: float = option(TIMESTEPS, 0.0, "mean of --timestep_sampling logit_normal", parse=float)
    logit_std: float = option(TIMESTEPS, 1.0, "std of --timestep_sampling logit_normal", parse=float, above=0.0)
    sigmoid_scale: float = option(TIMESTEPS, 1.0, "scale of --timestep_sampling sigmoid", parse=float, above=0.0)
    timestep_strata: int = option(TIMESTEPS, 1, "N > 1: every N draws of a rank take one from each of N equal parts of "
                                  "the distribution (stratified); 1: independent draws", parse=int, at_least=1)
    loss_weighting: str = option(TIMESTEPS, "diffsynth", "diffsynth (DiffSynth's per-timestep weight) or none",
                                 choices=("diffsynth", "none"), recipe="loss_weighting")
    # objective (docs/recipe/objective.md)
    objective: str = option(OBJECTIVE, "modes", "modes: images train text-to-image, videos image-to-video with frame 0 "
                            "out of the loss or text-to-video; diffsynth: DiffSynth 1.1.8's objective bit for bit "
                            "(every sample conditioned on its first frame, frame 0 in the loss)",
                            choices=("modes", "diffsynth"), recipe="objective")
    i2v_probability: float = option(OBJECTIVE, 1.0, "the share of video samples trained image-to-video (conditioned on "
                                    "their first frame), the rest text-to-video; decided per sample from --seed, rank "
                                    "and epoch (0.5 for a LoRA meant for text-to-video too)", parse=float,
                                    at_least=0.0, at_most=1.0, recipe="i2v_probability")
    # output and logging
    output_path: str = option(OUTPUT, "./runs/lora", "where the LoRA safetensors go", path=True)
    log_dir: str | None = option(OUTPUT, None, f"per-rank {STATUS_FILE}/.jsonl", path=True,
                                 unset="OUTPUT_PATH/training_logs, so two runs never share one; a preset's follows "
                                       "an --output_path given without it")
    run_id: str | None = option(OUTPUT, None, "names this run in the logs", unset="time-based")
    save_steps: int | None = option(OUTPUT, None, "also save the LoRA every N optimizer steps", parse=int, at_least=1,
                                    optional=True, unset="off")
    status_interval_s: float = option(OUTPUT, 5.0, "at most one status rewrite per N s", parse=float, above=0.0)
    dist_backend: str | None = option(OUTPUT, None, "the process group's backend", choices=("nccl", "gloo"),
                                      unset="nccl on GPUs, gloo on CPU")
    report_to: str = option(OUTPUT, "none", "none, tensorboard (pip install -e '.[tensorboard]'; event files in "
                            "OUTPUT_PATH/tracking/RUN_ID) or wandb, through accelerate's trackers: the JSONL's scalars "
                            "every optimizer step, from rank 0", choices=("none", "tensorboard", "wandb"))
    print_every_s: float = option(OUTPUT, 30.0, "without a terminal, rank 0 prints a progress line this often and at "
                                  "every epoch end", parse=float, above=0.0)
    keep_old_histories: int = option(OUTPUT, 3, f"a new run sets the previous history aside as *{OLD_HISTORY_SUFFIX}; keep the "
                                     "newest N of them", parse=int, at_least=0)
    # checkpoints, resume and stopping
    checkpoint_steps: int | None = option(CHECKPOINTS, None, "full training state every N optimizer steps", parse=int,
                                          at_least=1, optional=True, unset="off")
    checkpoint_minutes: float | None = option(CHECKPOINTS, None, "... and/or every M minutes, whichever comes first",
                                              parse=float, above=0.0, optional=True, unset="off")
    keep_checkpoints: int = option(CHECKPOINTS, 3, "keep the newest K plus any with a KEEP file", parse=int,
                                   at_least=1)
    checkpoint_dir: str | None = option(CHECKPOINTS, None, "where the checkpoints go (shared by all nodes)", path=True,
                                        unset="OUTPUT_PATH/checkpoints; a preset's follows an --output_path given "
                                              "without it")
    resume: str | None = option(CHECKPOINTS, None, "'latest' or a checkpoint folder: continue at its exact step and "
                                "data position", unset="none, a new run")
    force_resume: bool = option(CHECKPOINTS, False, "resume even if the configuration differs", parse=parse_bool)
    start_over: bool = option(CHECKPOINTS, False, "a new run in a checkpoint folder holding another run's checkpoints: "
                              f"move them into CHECKPOINT_DIR/{replaced_folder_name('RUN_ID')}/ and start (false: refused, naming them)",
                              parse=parse_bool)
    stop_grace_s: float = option(CHECKPOINTS, 300.0, "after Ctrl-C/SIGTERM, how long ranks may take to finish the step "
                                 "and save", parse=float, above=0.0)
    # bad media and validation
    max_bad_media_fraction: float = option(VALIDATION, 0.01, "stop when more than this share of samples (and over 10) "
                                           "fail to decode; each bad one is replaced by the next row and reported",
                                           parse=float, at_least=0.0, at_most=1.0)
    val_metadata_path: str | None = option(VALIDATION, None, "metadata_val.csv for validation loss", path=True,
                                           optional=True, unset="none, no validation", sample=True)
    val_base_path: str | None = option(VALIDATION, None, "folder the validation metadata's paths are relative to",
                                       path=True, optional=True, unset="--dataset_base_path", sample=True)
    val_steps: int | None = option(VALIDATION, None, "validation loss every N optimizer steps (and at the end)",
                                   parse=int, at_least=1, optional=True, unset="at the end only")
    val_samples: int = option(VALIDATION, 16, "fixed validation subset size", parse=int, at_least=1, sample=True)
    health_steps: int | None = option(
        VALIDATION, None, "LoRA health (update and gradient norms per DiT block, flags: still, exploding, nonfinite, "
        "overfitting) at step 0, every N optimizer steps and at the end (0: off; docs/training.md, LoRA health)",
        parse=int, at_least=0, optional=True, unset=f"{HEALTH_STEPS['lora']}, with --lora_variant dora "
        f"{HEALTH_STEPS['dora']}: a DoRA record costs 15 times a LoRA's")
    early_stop: int | None = option(VALIDATION, None, "stop (a checkpoint, status finished, exit 0) after N "
                                    "validations in a row without an improvement of --early_stop_min_delta, or off. "
                                    f"The best LoRA is kept either way ({BEST_LORA})",
                                    parse=validations_or_off, unset="off, the run trains its planned total")
    early_stop_min_delta: float = option(VALIDATION, 0.001, "what counts as an improvement for --early_stop: at least "
                                         "this share (0.01: 1%) below the loss the count was last reset at",
                                         parse=float, at_least=0.0, at_most=1.0)
    val_timestep_quantiles: tuple = option(VALIDATION, "0.1,0.3,0.5,0.7,0.9", "validation loss at these fixed points "
                                           "of the noise schedule, comma-separated in [0, 1); the headline val_loss is "
                                           "their mean", listed=quantiles, sample=True)
    # sample clips
    sample_prompts: str | None = option(SAMPLES, None, "YAML or JSON lines of prompts (prompt, optional image, seed, "
                                        "height, width, num_frames, steps, cfg_scale, negative_prompt): rank 0 renders "
                                        "them before the first step, every --sample_steps and at the end, into "
                                        "OUTPUT_PATH/samples/", path=True, optional=True, unset="none, no sample clips")
    sample_steps: int | None = option(SAMPLES, None, "render the sample prompts every N optimizer steps", parse=int,
                                      at_least=1, optional=True, unset="before the first step and at the end only")
    sample_strengths: tuple = option(SAMPLES, "1", "render each sample prompt at each of these LoRA strengths, same "
                                     "seed, e.g. 0,0.5,1 (0: the base model, rendered once per prompt into "
                                     "samples/base/)", listed=parse_strengths)
    # captions
    caption_dropout: float = option(CAPTIONS, 0.0, "train on the empty prompt instead of the caption with this "
                                    "probability, decided per sample from --seed, rank and epoch (0: never)",
                                    parse=float, at_least=0.0, at_most=1.0, fingerprint=True,
                                    recipe="captions.dropout")
    caption_prefix: str = option(CAPTIONS, "", "text put before every caption, with one space (a trigger word); a "
                                 "latent cache must be built with the same", fingerprint=True, recipe="captions.prefix")
    caption_suffix: str = option(CAPTIONS, "", "text put after every caption, with one space; a latent cache must be "
                                 "built with the same", fingerprint=True, recipe="captions.suffix")
    # EMA of the LoRA weights (training/lora/ema.py)
    ema_decay: float | None = option(EMA, None, "keep an fp32 exponential moving average of the LoRA with this decay "
                                     f"(e.g. 0.999), written as {ema_twin_name('<name>' + LORA_SUFFIX)} beside every LoRA file and kept "
                                     "in checkpoints", parse=float, above=0.0, below=1.0, unset="none, no EMA",
                                     recipe="ema.decay")
    ema_warmup: bool = option(EMA, True, "true: update n uses min(decay, (1 + n) / (10 + n)), so the EMA follows the "
                              "weights at first; false: the decay from the first update", parse=parse_bool,
                              recipe="ema.warmup")
    validate_with: str = option(EMA, "raw", "weights of validation loss and sample clips: raw, ema, or both (the EMA's "
                                "as val_loss_ema and *-ema clips)", choices=WEIGHTS, recipe="ema.validate_with")

    def __post_init__(self):
        """A list option given as text (a run's record, a test, ``replace``) holds its values parsed, like any other."""
        for name in LISTED:
            object.__setattr__(self, name, DECLARATIONS[name].typed(getattr(self, name)))

    def as_dict(self) -> dict:
        """Every option by name, as typed here."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def recorded(self) -> dict:
        """Every option by name as a preset and ``run_options.json`` hold it (list options as text, catalogues as
        mappings)."""
        values = {name: declaration.recorded(getattr(self, name)) for name, declaration in DECLARATIONS.items()}
        if values["datasets"]:
            values["datasets"] = [dataclasses.asdict(item) for item in values["datasets"]]
        return values

    def replace(self, **changes) -> "TrainOptions":
        """These options with some changed (the object itself never changes)."""
        return dataclasses.replace(self, **changes)


DECLARATIONS = declared(TrainOptions)
DEFAULTS = {name: declaration.default for name, declaration in DECLARATIONS.items()}
LISTED = tuple(name for name, declaration in DECLARATIONS.items() if declaration.listed)
NO_STAGES = ListValue()   # --resolution_stages unset: every step at the final size
