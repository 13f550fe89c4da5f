"""Seconds per optimizer step of the training's own step: images batched vs one by one, the speed issue's table
of step choices, and encoding every step vs training from the latent cache.

Every mode times what ``python -m diffsynth_mbc.train`` runs for one optimizer step (``step_timing.py``):
the ``Accelerator`` the training starts (``--mixed-precision``, resolved by the training's rule; single
process), the ``WanTI2VLoraModule`` it builds (LoRA rank 32 on q,k,v,o,ffn.0,ffn.2, fp32 weights),
AdamW, ``accelerator.prepare`` (autocast, and the loss scaler under fp16), and each step through
``training.step.micro_batch.forward_backward`` (clipping at 1.0, the optimizer step). Reported per row: the
median over ``--runs`` runs of the mean s/step of ``--steps`` steps (after ``--warmup`` steps), samples/s,
DiT tokens/s, MFU, and peak memory (CUDA: max_memory_allocated, and reserved in brackets; CPU: the
process's peak RSS), plus the attention kernels the profiler saw and any step skipped as non-finite.

Default mode: the tiny demo-width DiT (164k parameters, TI2V-5B's flags; on the CPU when there is no GPU)
trained from cache-like inputs at the real sizes (random latents 48x5x44x80 for 1280x704x17, 48x1x44x80 for a
1280x704 image, a 32x32 text embedding), in one process, three rows timed in turns, run by run: 1 video per
forward, N images one per forward (what ``--image_batch_size 1`` trains) and the same N images in one forward
(N = ``--image-batch``, default 5: as many tokens as one video), then the ratio of images/s, of the medians and
run by run (run i of the two image rows ran back to back, so on a busy machine their ratio is the steadier one):

    python benchmarks/bench_cache.py [--runs 5 --steps 2 --warmup 2] [--images] [--image-batch 5]

The step's choices, in any mode but ``--cases``: ``--mixed-precision auto|bf16|fp16|fp32``, ``--attention
auto|flash|cudnn|efficient|math`` (only that SDPA backend, through ``torch.nn.attention.sdpa_kernel``),
``--lora-compute base|upcast`` (upcast: peft's own forward, the step as first built), ``--compile
auto|on|off``, ``--gradient-checkpointing all|none|auto|N``, ``--fp32-residual auto|on|off`` (``off``: DiffSynth's
forward, the residual stream in the model's dtype), ``--batch B`` videos per forward; ``--images``
drops the video row. The defaults are the training command's own: every block recomputed, where the launchers'
presets train ``auto`` (the fewest blocks that fit the GPU, resolved by the training's rule; none on an
H100 or H200), so pass ``--gradient-checkpointing auto`` to time what a preset run does.

Full size, on a CUDA GPU only (it refuses otherwise, exit 2): a randomly initialised Wan2.2-TI2V-5B DiT
(``models.pipeline.TI2V_5B_DIT``) trained from cache-like inputs (latents 48x5x44x80, context 512x4096), the
same three rows, or with ``--cases`` the speed issue's table, each case in a process of its own so that
memory figures and compile caches do not mix (as built = peft's upcasting LoRA, every block checkpointed, not
compiled, DiffSynth's forward with the residual stream in the model's dtype; each case changes what its label says):

    python benchmarks/bench_cache.py --full-size [--mixed-precision bf16 --attention cudnn --compile on
                                     --gradient-checkpointing 20 --lora-compute base --images --image-batch 5]
    python benchmarks/bench_cache.py --full-size --cases [--runs 5 --steps 5 --peak-tflops 989]

``--cases`` also runs at the tiny size (no ``--full-size``), where it exercises the same code; kernels or
precisions the device lacks (fp16 on the CPU, memory-efficient SDPA on the CPU) show as refused rows.

Encoding every step vs the cache (tiny demo model; the VAE and text encoder encode 128x128x17 mp4 clips on
every step, or the latent cache built from them beforehand, timed as the one-off cost), each path in its own
process so that the peak RSS is that path's alone:

    python benchmarks/bench_cache.py --encode [--height 128 --width 128 --num-frames 17 --rows 4]

MFU counts the DiT's training FLOPs only, per sample (images attend within themselves):

    FLOPs/sample = 6 * P * T  +  12 * L * d * T^2  +  12 * L * d * T * S

P = DiT parameters (LoRA excluded), T = DiT tokens = latent frames x (H/32) x (W/32) (4,400 at 1280x704x17,
880 for a 1280x704 image), L layers, d width, S text positions (512); 6PT is the usual forward+backward matmul
count, the other terms are self- and cross-attention (QK^T and AV, forward x3 for training). LoRA skips the
frozen weights' gradients and checkpointing recomputes the forward, so the hardware does roughly (4+2)PT: the
6PT convention is kept for comparability. MFU = FLOPs/step / (s/step x peak dense bf16 FLOP/s, fp16 on a V100),
the peak looked up from the device name or given with --peak-tflops; none on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_timing import (ATTENTION_CHOICES, Batches, Feed, Geometry, Setting, build_step_run,  # noqa: E402
                         cache_like_entries, peak_flops, refuse_to_start, random_dit_pipeline, summarise, time_feeds)

NO_CUDA = ("--full-size needs a CUDA GPU (the random 5B DiT is built in fp32, about 20 GB, then cast; a step "
           "without checkpointing needs about 40 GB); none is visible here. Run without --full-size for the tiny "
           "model on this machine.")
SETTING_FLAGS = ("attention", "lora_compute", "compile", "gradient_checkpointing", "fp32_residual")

AS_BUILT = {"lora_compute": "upcast", "gradient_checkpointing": "all", "compile": "off", "attention": "auto",
            "fp32_residual": "off"}
NEW_STEP = {"lora_compute": "base", "compile": "on"}
# (label, changes to the step as it was built, kind); images per forward: 1, or --image-batch for "batched".
CASES = [
    ("as built (upcast LoRA, all checkpointed)", {}, "video"),
    ("memory-efficient SDPA only", {"attention": "efficient"}, "video"),
    ("math SDPA only", {"attention": "math"}, "video"),
    ("no checkpointing", {"gradient_checkpointing": "none"}, "video"),
    ("LoRA in base dtype", {"lora_compute": "base"}, "video"),
    ("base dtype + compiled, all checkpointed", NEW_STEP, "video"),
    ("base dtype + compiled, none checkpointed", {**NEW_STEP, "gradient_checkpointing": "none"}, "video"),
    ("fp16 + efficient + compiled (a V100's path)", {**NEW_STEP, "mixed_precision": "fp16",
                                                     "attention": "efficient"}, "video"),
    ("... with the fp32 residual stream (a V100's path now)",
     {**NEW_STEP, "mixed_precision": "fp16", "attention": "efficient", "fp32_residual": "on"}, "video"),
    ("base dtype + compiled, fp32 residual stream", {**NEW_STEP, "fp32_residual": "on"}, "video"),
    ("1 image per forward, as built", {}, "image"),
    ("{n} images per forward, as built", {}, "batched"),
    ("{n} images per forward, base dtype + compiled (new defaults)", NEW_STEP, "batched"),
]


# ---------------------------------------------------------------------------------------------
# options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_argument_group("mode")
    mode.add_argument("--full-size", action="store_true", help="Wan2.2-TI2V-5B's DiT at full size (CUDA only)")
    mode.add_argument("--cases", action="store_true", help="the speed issue's table, each case in its own process")
    mode.add_argument("--encode", action="store_true", help="tiny demo: encoding every step vs the latent cache")
    step = parser.add_argument_group("the step (defaults: the training's)")
    step.add_argument("--mixed-precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                      help="as the training's --mixed_precision (auto: bf16 on sm80+, fp16 below, fp32 on the CPU)")
    step.add_argument("--attention", choices=ATTENTION_CHOICES,
                      help="allow only this SDPA backend (torch.nn.attention.sdpa_kernel); default auto")
    step.add_argument("--lora-compute", choices=("base", "upcast"),
                      help="base (default): fp32 LoRA weights computed in the DiT's dtype; upcast: peft's own "
                           "forward, activations cast to fp32 (the step as first built)")
    step.add_argument("--compile", choices=("auto", "on", "off"), help="torch.compile each DiT block (default auto)")
    step.add_argument("--gradient-checkpointing", metavar="all|none|auto|N",
                      help="blocks that recompute in backward: every one (default, as the training's own), none, "
                           "auto (the fewest that fit this GPU: what the presets train), the first N")
    step.add_argument("--fp32-residual", choices=("auto", "on", "off"),
                      help="as the training's --fp32_residual: the DiT's time embedding, modulation and residual "
                           "stream in fp32 (auto, default: under fp16 and bf16), or DiffSynth's forward (off)")
    step.add_argument("--batch", type=int, default=1, help="videos per forward (default 1)")
    step.add_argument("--images", action="store_true", help="time images only (1280x704x1 each), no video row")
    step.add_argument("--image-batch", type=int, help="images per forward (default: as many tokens as --batch "
                                                       "videos, 5 at 17 frames)")
    step.add_argument("--lora-rank", type=int, default=32)
    size = parser.add_argument_group("sizes and repetitions")
    size.add_argument("--height", type=int, help="default 704 (128 with --encode)")
    size.add_argument("--width", type=int, help="default 1280 (128 with --encode)")
    size.add_argument("--num-frames", type=int, help="default 17")
    size.add_argument("--rows", type=int, default=4, help="--encode: clips in the demo catalogue (cycled through)")
    size.add_argument("--runs", type=int, default=5)
    size.add_argument("--steps", type=int, help="optimizer steps per run (default 5 full size, 2 otherwise)")
    size.add_argument("--warmup", type=int, default=2, help="untimed steps per row first (compiling happens here)")
    size.add_argument("--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s for MFU")
    size.add_argument("--memory-cap-gib", type=float,
                      help="CUDA: let this process allocate at most this many GiB (a smaller card's analog, e.g. 30 "
                           "for a 32 GB V100); an allocation past it fails as it would there")
    size.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = [f"--{name.replace('_', '-')}" for name in SETTING_FLAGS if getattr(args, name) is not None]
    if args.cases and (given or args.images):
        parser.error(f"--cases sets the step per case; drop {' '.join(given + ['--images'] * args.images)}")
    if args.encode and (args.full_size or args.cases or args.images or args.image_batch):
        parser.error("--encode is the tiny demo's video comparison; it does not combine with --full-size, --cases, "
                     "--images or --image-batch")
    if args.gradient_checkpointing is not None:
        from diffsynth_mbc.errors import OptionsError
        from diffsynth_mbc.training.plan.recompute import parse_choice

        try:
            parse_choice(args.gradient_checkpointing)
        except OptionsError as exc:
            parser.error(str(exc).replace("--gradient_checkpointing", "--gradient-checkpointing"))
    args.height = args.height or (128 if args.encode else 704)
    args.width = args.width or (128 if args.encode else 1280)
    args.num_frames = args.num_frames or 17
    args.steps = args.steps or (5 if args.full_size else 2)
    if args.height % 32 or args.width % 32 or args.num_frames % 4 != 1:
        parser.error("--height and --width must be multiples of 32 and --num-frames 4k+1")
    for name in ("batch", "image_batch", "runs", "steps", "rows", "lora_rank"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    if args.image_batch is None:
        from diffsynth_mbc.training.plan.batches import default_image_batch_size
        args.image_batch = default_image_batch_size(args.batch, args.num_frames)
    return args


def setting_from(args, **changes) -> Setting:
    chosen = {name: getattr(args, name) for name in SETTING_FLAGS if getattr(args, name, None) is not None}
    defaults = {"attention": "auto", "lora_compute": "base", "compile": "auto", "gradient_checkpointing": "all",
                "fp32_residual": "auto"}
    return Setting(**{**defaults, "mixed_precision": args.mixed_precision, **chosen, **changes})


def geometry(args) -> Geometry:
    from diffsynth_mbc.models.pipeline import TINY_DIT, TINY_TEXT_LEN

    text = (512, 4096) if args.full_size else (TINY_TEXT_LEN, TINY_DIT["text_dim"])
    return Geometry(args.height, args.width, args.num_frames, *text)


def dit_config(args) -> dict:
    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT, TINY_DIT

    return TI2V_5B_DIT if args.full_size else TINY_DIT


def default_feeds(args) -> list[Feed]:
    n, geo = args.image_batch, geometry(args)
    feeds = [] if args.images else [
        Feed(f"{args.batch} video{'s' * (args.batch > 1)} {geo.describe('video')} per forward", "video",
             args.batch, args.steps)]
    return feeds + [Feed(f"{n} images {geo.describe('image')}, one per forward", "image", 1, args.steps * n),
                    Feed(f"{n} images {geo.describe('image')} in one forward", "image", n, args.steps)]


# ---------------------------------------------------------------------------------------------
# measuring one setting (in this process)


def measure(args, setting: Setting, feeds: list[Feed], source: str = "synthetic", data: str | None = None) -> dict:
    """Build the training's step for ``setting`` and time ``feeds`` on it."""
    from diffsynth_mbc.training.step.micro_batch import sample_tokens

    geo = geometry(args)
    make_pipe = random_dit_pipeline(dit_config(args)) if source == "synthetic" else demo_pipeline(data, source)
    run, info = build_step_run(setting, make_pipe, args.lora_rank)
    pipe = run.accelerator.unwrap_model(run.module).pipe
    if source == "synthetic":
        counts = {}
        for feed in feeds:
            counts[feed.kind] = max(counts.get(feed.kind, 2), feed.per_forward)
        pools = {kind: cache_like_entries(geo, kind, count, pipe.torch_dtype, seed=index)
                 for index, (kind, count) in enumerate(sorted(counts.items()))}
    else:
        pools = {"video": demo_dataset(args, data, source)}
    tokens = {kind: sample_tokens(pool[0]) for kind, pool in pools.items()}
    timed = time_feeds(run, feeds, Batches(pools), args.warmup, args.runs, setting.attention)
    blocks = run.accelerator.unwrap_model(run.module).blocks
    info.update(compiled=blocks.compiled, compile_status=run.status.state.get("compile_reason"))
    peak = peak_flops(info["device"], args.peak_tflops)
    return {"setting": dataclasses.asdict(setting), "info": info, "peak_flops": peak,
            "feeds": [summarise(feed, timed[feed.label], tokens[feed.kind], info, geo.text_len, peak)
                      for feed in feeds]}


def demo_pipeline(data: str, source: str):
    def make(device, dtype):
        from diffsynth_mbc.models.pipeline import build_demo_pipeline

        return build_demo_pipeline(device=str(device), torch_dtype=dtype, seed=42, load_encoders=source == "encode",
                                   tokenizer_dir=str(Path(data) / ".tokenizer"))
    return make


def demo_dataset(args, data: str, source: str):
    root = Path(data)
    if source == "cache":
        from diffsynth_mbc.data.cache.dataset import CachedLatentDataset
        return CachedLatentDataset(root / "cache")
    from diffsynth_mbc.data.dataset import MBCVideoDataset
    return MBCVideoDataset(str(root / "catalog"), str(root / "metadata" / "metadata.csv"),
                           num_frames=args.num_frames, height=args.height, width=args.width)


def run_worker(args) -> int:
    """One job from the parent (a case of --cases, or a path of --encode): JSON in, JSON out (last line)."""
    job = json.loads(args.worker)
    feed = Feed(**job["feed"])
    try:
        result = measure(args, Setting(**job["setting"]), [feed], job.get("source", "synthetic"), job.get("data"))
    except Exception as exc:  # noqa: BLE001 - reported in the parent's table as this case's outcome
        print(json.dumps({"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}))
        return 1
    print(json.dumps(result))
    return 0


def in_child(args, argv: list[str], job: dict) -> dict:
    """``job`` measured in a process of its own (clean memory figures, compile caches and accelerate state)."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", json.dumps(job)]
    child = subprocess.run(command, capture_output=True, text=True,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = child.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (child.stderr.strip().splitlines() or [f"exit code {child.returncode}"])[-1]
        return {"error": f"the worker died (exit code {child.returncode}): {tail[:300]}"}


# ---------------------------------------------------------------------------------------------
# the modes


def run_default(args) -> dict:
    setting = setting_from(args)
    result = measure(args, setting, default_feeds(args))
    rows = [{**feed, "detail": detail(result, feed)} for feed in result["feeds"]]
    one, batched = rows[-2], rows[-1]
    # Run i of both rows ran back to back, so their ratio is the one least disturbed by a busy machine.
    paired = [batched["samples_per_step"] * one_s / batched_s
              for one_s, batched_s in zip(one["s_per_step_runs"], batched["s_per_step_runs"])]
    return {"mode": describe_mode(args, result), "rows": rows,
            "images_ratio": {"one_per_forward_images_per_s": one["samples_per_s"],
                             "batched_images_per_s": batched["samples_per_s"],
                             "images_per_forward": batched["samples_per_step"],
                             "ratio": batched["samples_per_s"] / one["samples_per_s"],
                             "ratio_per_run": paired, "median_ratio_per_run": statistics.median(paired)}}


def run_cases(args, argv: list[str]) -> dict:
    rows, first = [], None
    for label, changes, kind in CASES:
        per_forward = {"video": args.batch, "image": 1, "batched": args.image_batch}[kind]
        label = label.format(n=args.image_batch)
        setting = setting_from(args, **{**AS_BUILT, **changes})
        feed = Feed(label, "video" if kind == "video" else "image", per_forward, args.steps)
        started = time.perf_counter()
        print(f"case {len(rows) + 1}/{len(CASES)}: {label} ...", file=sys.stderr, flush=True)
        result = in_child(args, argv, {"setting": dataclasses.asdict(setting), "feed": dataclasses.asdict(feed)})
        if "error" in result:
            rows.append({"label": label, "error": result["error"], "setting": dataclasses.asdict(setting)})
        else:
            first = first or result
            rows.append({**result["feeds"][0], "detail": detail(result, result["feeds"][0])})
        print(f"  {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {"mode": describe_mode(args, first) if first else "no case ran", "rows": rows}


def run_encode(args, argv: list[str]) -> dict:
    """The tiny demo's encode-every-step vs cache comparison: catalogue, cache (timed), one process per path."""
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as folder:
        summary = prepare_demo_data(Path(folder), args)
        rows = []
        for source, label in (("encode", "video, encoded every step (VAE + T5 + DiT)"),
                              ("cache", "video, from the latent cache (DiT only)")):
            feed = Feed(label, "video", args.batch, args.steps)
            job = {"setting": dataclasses.asdict(setting_from(args)), "feed": dataclasses.asdict(feed),
                   "source": source, "data": folder}
            result = in_child(args, argv, job)
            if "error" in result:
                raise RuntimeError(f"the {source} path failed: {result['error']}")
            rows.append({**result["feeds"][0], "detail": detail(result, result["feeds"][0])})
    return {"mode": describe_mode(args, result, demo=True), "rows": rows, "cache": summary,
            "ratio_encode_over_cached": rows[0]["s_per_step"] / rows[1]["s_per_step"]}


def prepare_demo_data(root: Path, args) -> dict:
    from diffsynth_mbc.data import convert
    from diffsynth_mbc.data.cache import cli as cache
    from diffsynth_mbc.data.demo_data import make_demo_catalog

    catalog = make_demo_catalog(root / "catalog", num_videos=args.rows, num_images=0, width=args.width,
                                height=args.height, num_frames=args.num_frames, seed=0)
    if convert.main([str(catalog), "--base-path", str(root / "catalog"), "--output", str(root / "metadata")]) != 0:
        raise RuntimeError("converting the benchmark catalogue failed")
    started = time.perf_counter()
    code = cache.main(["--demo", "--dataset_base_path", str(root / "catalog"), "--dataset_metadata_path",
                       str(root / "metadata" / "metadata.csv"), "--height", str(args.height), "--width",
                       str(args.width), "--num_frames", str(args.num_frames), "--cache_dir", str(root / "cache"),
                       "--dataset_num_workers", "0", "--dtype", "fp32"])
    if code != 0:
        raise RuntimeError(f"building the cache failed with exit code {code}")
    summary = json.loads((root / "cache" / "summary.json").read_text())
    summary["build_seconds_incl_model"] = time.perf_counter() - started
    return summary


# ---------------------------------------------------------------------------------------------
# the report


def describe_mode(args, result: dict, demo: bool = False) -> str:
    info = result["info"]
    model = ("Wan2.2-TI2V-5B DiT, random weights" if args.full_size else
             "tiny demo pipeline (VAE, T5, DiT)" if demo else "tiny demo-width DiT, random weights")
    inputs = ("real mp4 clips / their latent cache" if demo else "cache-like inputs (random latents and context)")
    return (f"{info['device']}, torch {info['torch']}; {model} (DiT: {info['dit_parameters']:,} parameters), {inputs}; "
            f"LoRA rank {info['lora_rank']} on q,k,v,o,ffn.0,ffn.2 ({info['lora_parameters']:,} fp32 parameters), "
            f"AdamW; {args.runs} runs x {args.steps} steps after {args.warmup} warm-up steps per row")


def detail(result: dict, feed: dict) -> str:
    info, setting = result["info"], result["setting"]
    compiled = "compiled" if info["compiled"] else "not compiled"
    if setting["compile"] == "on" and not info["compiled"]:
        compiled += f" ({info['compile_status']})"
    attention = ", ".join(feed["attention_kernels"])
    if info["dit_attention_path"] != "torch SDPA":
        attention = info["dit_attention_path"]
    precision = "fp32" if info["mixed_precision"] == "no" else f"{info['mixed_precision']} autocast"
    lora = "fp32 (upcast)" if setting["lora_compute"] == "upcast" else info["model_dtype"]
    return (f"{precision}, {info['model_dtype']} DiT; SDPA allowed: {setting['attention']}, ran: {attention}; "
            f"LoRA computes in {lora}; {info['recompute_blocks']}/{info['num_blocks']} blocks recompute; {compiled}; "
            f"{feed['skipped_steps']} of {feed['timed_steps']} timed steps skipped (non-finite); warm-up "
            f"{feed['warmup_s']:.1f} s; s/step per run: " + " ".join(f"{t:.4f}" for t in feed["s_per_step_runs"]))


def memory_cell(row: dict) -> str:
    if "max_memory_allocated_gib" in row:
        return f"{row['max_memory_allocated_gib']:.1f} ({row['max_memory_reserved_gib']:.1f})"
    return f"{row['peak_rss_mib']:.0f}"


def table(rows: list[dict]) -> list[str]:
    gpu = any("max_memory_allocated_gib" in row for row in rows)
    width = max(len(row["label"]) for row in rows) + 4
    lines = [f"{'case':<{width}}{'s/step':>9}{'samples/s':>11}{'tokens/s':>11}{'MFU':>7}"
             f"{'GiB alloc (reserved)' if gpu else 'peak RSS MiB':>22}{'x 1st':>8}"]
    first = next((row for row in rows if "error" not in row), None)
    for index, row in enumerate(rows, 1):
        label = f"{index:>2}. {row['label']}"
        if "error" in row:
            lines.append(f"{label:<{width}}  refused or failed: {row['error']}")
            continue
        mfu = f"{row['mfu'] * 100:.1f}%" if row.get("mfu") is not None else "-"
        lines.append(f"{label:<{width}}{row['s_per_step']:>9.4f}{row['samples_per_s']:>11.3f}"
                     f"{row['tokens_per_s']:>11.0f}{mfu:>7}{memory_cell(row):>22}"
                     f"{row['tokens_per_s'] / first['tokens_per_s']:>7.2f}x")
    return lines


def report(result: dict) -> str:
    lines = [f"mode: {result['mode']}"]
    if "cache" in result:
        summary = result["cache"]
        load = sum(rank["model_load_seconds"] for rank in summary["per_rank"])
        per_clip = (summary["seconds"] - load) / max(summary["rows_cached"], 1)
        lines.append(f"cache build: {summary['rows_cached']} clips in {summary['seconds']:.1f} s, of which "
                     f"{load:.1f} s building the encoders ({per_clip:.2f} s/clip after that), "
                     f"{summary['bytes_per_sample']} bytes/sample; projected 1280x704x17 bf16: "
                     f"{summary['projected_1280x704x17_bf16']['mib']:.3f} MiB/sample")
    lines += table(result["rows"])
    lines.append("x 1st: tokens/s relative to row 1. MFU: (6PT + attention) FLOPs / (s/step x peak); "
                 "see the docstring.")
    for index, row in enumerate(result["rows"], 1):
        if "detail" in row:
            lines.append(f"{index:>2}. {row['detail']}")
    if "images_ratio" in result:
        ratio = result["images_ratio"]
        lines.append(f"images/s: {ratio['batched_images_per_s']:.3f} with {ratio['images_per_forward']} per forward vs "
                     f"{ratio['one_per_forward_images_per_s']:.3f} one per forward: {ratio['ratio']:.2f}x (run by run: "
                     + " ".join(f"{r:.2f}x" for r in ratio["ratio_per_run"])
                     + f"; median {ratio['median_ratio_per_run']:.2f}x)")
    if "ratio_encode_over_cached" in result:
        lines.append(f"encode-every-step / cached: {result['ratio_encode_over_cached']:.1f}x s/step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    refusal = refuse_to_start("bench_cache.py", args.full_size, f"bench_cache.py: {NO_CUDA}", args.memory_cap_gib)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if args.worker:
        return run_worker(args)
    result = run_cases(args, argv) if args.cases else run_encode(args, argv) if args.encode else run_default(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
