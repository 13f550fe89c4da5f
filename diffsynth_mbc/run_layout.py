"""Every file and folder name of a run, in one module: names, patterns and the small functions that make them. The
training, the latent cache, ``sample``, ``export``, the doctor, the lifecycle and the monitor import them from here;
the launchers (bash) spell the three they need themselves (the lock, the launch's log, the status files in a log
line), and ``tests/test_launchers.py`` checks that they agree. No torch.

The output folder (``--output_path``)::

    lora.safetensors                 the LoRA at the end of the run (FINAL_LORA)
    lora-best.safetensors            the LoRA of the lowest validation so far (BEST_LORA)
    epoch-001.safetensors            at each epoch's end (epoch_file_name)
    step-40.safetensors              every --save_steps (step_file_name)
    *_ema.safetensors                each one's EMA twin, with --ema_decay (ema_twin_name)
    run_options.json                 the options as the training resolved them (RUN_OPTIONS)
    size_table.json                  every media file's size, by the file's fingerprint (SIZE_TABLE)
    datasets/metadata.csv            several catalogues as one (COMBINED_METADATA)
    train-RUN_ID.log                 the launch's log, written by the launcher (run_log_name)
    samples/step-00000040/           one set of sample clips (sample_set_name) with its prompts.json (PROMPTS_FILE)
    samples/base/                    the base model's clips (BASE_SAMPLES_FOLDER)
    tracking/                        tensorboard or wandb (TRACKING_FOLDER)
    training_logs/, checkpoints/     --log_dir and --checkpoint_dir unless given

The checkpoint folder (``--checkpoint_dir``)::

    step-00001234/                   a checkpoint (checkpoint_folder_name, step_of_folder)
        checkpoint.json              its manifest, written last (CHECKPOINT_MANIFEST)
        lora.safetensors             its LoRA (CHECKPOINT_LORA), row_sizes.json (ROW_SIZES),
                                     ema_state.safetensors (EMA_STATE), accelerate's state
                                     (random_states_R.pkl: rank_state_file), KEEP (KEEP_MARKER: never pruned)
    .tmp-step-00001234.ATTEMPT/      a checkpoint being written (checkpoint_temp_name)
    damaged-step-00001234[.N]/       one whose manifest could not be read, set aside (damaged_name)
    replaced-RUN_ID/                 another run's, moved aside by --start_over (replaced_folder_name)

The log folder (``--log_dir``)::

    training_gpu{rank}.json          a rank's status (status_file_name)
    training_gpu{rank}.jsonl         its history (history_file_name); a new run sets the old one aside as
                                     training_gpu{rank}.STAMP.jsonl.old (old_history_name)
    .train.lock, .train.pid          the run's lock and its record, also in the output and checkpoint folders
                                     (lock_name, lock_record_name; .train.nodeN.lock on node N)

The latent cache (``--cache_dir``): cache.json, summary.json, failures.csv, entries/, text/, shards/,
sample_prompts.safetensors, size_table.json, logs/ (its ranks' status files). A sweep's folder (``python -m
diffsynth_mbc.sample --output``): sweep.json, sweep.html, .sweep-records/rank-R.json while it renders, and a folder of
clips per LoRA file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# -- the output folder ----------------------------------------------------------------------------------------------
LORA_SUFFIX = ".safetensors"
FINAL_LORA = "lora.safetensors"
BEST_LORA = "lora-best.safetensors"
FINAL_LORA_STEM = FINAL_LORA.removesuffix(LORA_SUFFIX)
BEST_LORA_STEM = BEST_LORA.removesuffix(LORA_SUFFIX)
EMA_TWIN_SUFFIX = "_ema"                 # lora_ema.safetensors, step-40_ema.safetensors
STEP_PREFIX = "step-"                    # step-40.safetensors; step-00001234/ (a checkpoint, a sample set)
EPOCH_PREFIX = "epoch-"
# Every LoRA file a run writes into its output folder: "stem" (lora, lora-best, epoch-001, step-40), "ema" (its twin).
LORA_FILE = re.compile(rf"^(?P<stem>{FINAL_LORA_STEM}|{BEST_LORA_STEM}|{EPOCH_PREFIX}\d+|{STEP_PREFIX}\d+)"
                       rf"(?P<ema>{EMA_TWIN_SUFFIX})?{re.escape(LORA_SUFFIX)}$")
RUN_OPTIONS = "run_options.json"
SIZE_TABLE = "size_table.json"
COMBINED_METADATA = Path("datasets") / "metadata.csv"
SAMPLES_FOLDER = "samples"
BASE_SAMPLES_FOLDER = "base"
PROMPTS_FILE = "prompts.json"            # beside each set's clips: the full text of every prompt
TRACKING_FOLDER = "tracking"
DEFAULT_LOGS_FOLDER = "training_logs"
DEFAULT_CHECKPOINTS_FOLDER = "checkpoints"
RUN_LOG_GLOB = "train-*.log"


def run_log_name(run_id: str) -> str:
    """The launch's log in the output folder (the launcher writes it: launchers/common.sh)."""
    return f"train-{run_id}.log"


def epoch_file_name(epoch: int, num_epochs: int) -> str:
    """The LoRA file written when epoch ``epoch`` (counted from 0, as the loop counts) ends, numbered from 1 as the
    terminal shows it ("epoch 1/5 done" writes ``epoch-001``) and zero-padded so that ``ls`` lists them in order.
    Runs of earlier versions wrote ``epoch-0`` for the first epoch; those files stay LoRA files like any other
    (export, DiffSynth and ComfyUI read them by their path, nothing reads the number)."""
    width = max(3, len(str(num_epochs)))
    return f"{EPOCH_PREFIX}{epoch + 1:0{width}d}{LORA_SUFFIX}"


def step_file_name(step: int) -> str:
    """The LoRA file of ``--save_steps``: ``step-40.safetensors`` (not padded, unlike a checkpoint's folder)."""
    return f"{STEP_PREFIX}{step}{LORA_SUFFIX}"


def ema_twin_name(file_name: str) -> str:
    """``lora.safetensors`` -> ``lora_ema.safetensors``; ``step-4.safetensors`` -> ``step-4_ema.safetensors``."""
    path = Path(file_name)
    return str(path.with_name(f"{path.stem}{EMA_TWIN_SUFFIX}{path.suffix}"))


# -- the checkpoint folder ------------------------------------------------------------------------------------------
CHECKPOINT_MANIFEST = "checkpoint.json"
CHECKPOINT_LORA = FINAL_LORA
ROW_SIZES = "row_sizes.json"
EMA_STATE = "ema_state.safetensors"
SCALER_FILE = "scaler.pt"                # accelerate's fp16 loss scaler, in a checkpoint saved under fp16
KEEP_MARKER = "KEEP"
TEMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = "damaged-"
REPLACED_PREFIX = "replaced-"
_STEP_FOLDER = re.compile(rf"{STEP_PREFIX}([0-9]{{8}})")


def step_folder_name(step: int) -> str:
    """``step-00001234``: a checkpoint's folder, a set of sample clips, a sweep's clips of a step's file."""
    return f"{STEP_PREFIX}{step:08d}"


def step_of_folder(name: str) -> int | None:
    """The step a folder named by ``step_folder_name`` holds; None for any other name."""
    match = _STEP_FOLDER.fullmatch(name)
    return int(match.group(1)) if match else None


def checkpoint_folder_name(step: int) -> str:
    return step_folder_name(step)


def sample_set_name(step: int) -> str:
    """The folder of the sample clips made at ``step`` (``samples/step-00000040``)."""
    return step_folder_name(step)


def checkpoint_temp_name(step: int, attempt: str = "") -> str:
    """``.tmp-step-00001234.ATTEMPT``: a checkpoint while it is written, renamed when complete."""
    return f"{TEMP_PREFIX}{checkpoint_folder_name(step)}" + (f".{attempt}" if attempt else "")


def published_name(temp_name: str) -> str:
    """The checkpoint folder a temp folder becomes: ``.tmp-step-00001234.ATTEMPT`` -> ``step-00001234``."""
    return temp_name[len(TEMP_PREFIX):].split(".")[0]


def damaged_name(name: str, copy: int = 0) -> str:
    """Where an unreadable checkpoint folder is set aside: ``damaged-step-00001234``, then ``.1``, ``.2`` ..."""
    return f"{DAMAGED_PREFIX}{name}" + (f".{copy}" if copy else "")


def replaced_folder_name(run_id: str) -> str:
    return f"{REPLACED_PREFIX}{run_id}"


def rank_state_file(rank: int) -> str:
    """The file accelerate writes once per rank in a checkpoint: that rank's RNG state (accelerate names it)."""
    return f"random_states_{rank}.pkl"


# -- the log folder -------------------------------------------------------------------------------------------------
_STATUS_STEM = "training_gpu"
STATUS_FILE = _STATUS_STEM + "{rank}.json"      # as people read it; status_file_name(rank) fills it in
HISTORY_FILE = _STATUS_STEM + "{rank}.jsonl"
STATUS_FILE_GLOB = STATUS_FILE.format(rank="*")
OLD_HISTORY_SUFFIX = ".jsonl.old"
_STATUS_NAME = re.compile(rf"{_STATUS_STEM}([0-9]+)\.json")
LOCK_PREFIX = ".train"
LOCK_SUFFIX = ".lock"


def status_file_name(rank: int) -> str:
    """A rank's status file, named by its *global* rank: the current state, replaced atomically."""
    return STATUS_FILE.format(rank=int(rank))


def history_file_name(rank: int) -> str:
    """A rank's history: one appended, flushed line per optimizer step (and per validation, overhead, ...)."""
    return HISTORY_FILE.format(rank=int(rank))


def status_path(log_dir: str | os.PathLike, rank: int) -> Path:
    return Path(log_dir) / status_file_name(rank)


def history_path(log_dir: str | os.PathLike, rank: int) -> Path:
    return Path(log_dir) / history_file_name(rank)


def rank_of_status_file(name: str) -> int | None:
    """Global rank encoded in a status file name, or None for any other file."""
    match = _STATUS_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def old_history_name(rank: int, stamp: str) -> str:
    """A previous run's history of this rank, set aside by a new run: ``training_gpu0.20250101-120000.jsonl.old``."""
    return f"{_STATUS_STEM}{int(rank)}.{stamp}{OLD_HISTORY_SUFFIX}"


def old_histories_glob(rank: int) -> str:
    return old_history_name(rank, "*")


def lock_name(machine_rank: int = 0) -> str:
    """One lock per node of a run: node 0 keeps the historical name."""
    node = "" if machine_rank == 0 else f".node{machine_rank}"
    return f"{LOCK_PREFIX}{node}{LOCK_SUFFIX}"


def lock_record_name(lock_file_name: str) -> str:
    """The record beside a lock (the launcher's pid, the run id): ``.train.lock`` -> ``.train.pid``."""
    return lock_file_name.removesuffix(LOCK_SUFFIX) + ".pid"


# -- the latent cache -----------------------------------------------------------------------------------------------
CACHE_INDEX = "cache.json"
CACHE_SUMMARY = "summary.json"
CACHE_FAILURES = "failures.csv"
CACHE_ENTRIES = "entries"
CACHE_TEXT = "text"
CACHE_SHARDS = "shards"
CACHE_SAMPLE_TEXTS = "sample_prompts.safetensors"
CACHE_LOGS = "logs"
DEFAULT_CACHE = "latent_cache"            # beside the output folder, unless --cache names one
DEFAULT_VAL_CACHE = "latent_cache_val"


def cache_shard_name(rank: int, world_size: int) -> str:
    """One cache rank's record of its share: ``rank-00001-of-00002.json`` in ``shards/``."""
    return f"rank-{rank:05d}-of-{world_size:05d}.json"


# -- a sweep's folder (python -m diffsynth_mbc.sample --output) -----------------------------------------------------
SWEEP_JSON = "sweep.json"
SWEEP_HTML = "sweep.html"
SWEEP_RECORDS = ".sweep-records"         # each process's clip records while it renders, merged into sweep.json
SWEEP_RECORDS_GLOB = "rank-*.json"


def sweep_records_name(rank: int) -> str:
    return f"rank-{rank}.json"
