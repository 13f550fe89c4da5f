"""Seconds per row of the latent cache's encoding: the cache builder's own ``Encoder`` (DiffSynth's media units:
the VAE encodes the clip and, for the first-frame condition, its first frame; the prompt unit: the text encoder),
one row at a time as ``python -m diffsynth_mbc.cache`` encodes them, in one process on one device.

    python benchmarks/bench_encode.py [--runs 5 --warmup 1] [--height 704 --width 1280 --num-frames 17]
    python benchmarks/bench_encode.py --full-size [--dtype bf16|fp16|fp32] [--memory-cap-gib 30] [--json out.json]

Default: the demo's tiny encoders (the Wan2.2 VAE class with narrow widths, a one-layer text encoder) on this
machine (CUDA when there is one), which exercises the same code at 128x128x17 unless sizes are given.
``--full-size`` (CUDA only; exit 2 otherwise): the Wan2.2 VAE (z 48, width 160) and the umt5-xxl text encoder
at full size, randomly initialised on the GPU in the cache's dtype (the weights' values do not change the time),
with the demo's word-level tokenizer: every prompt is padded to 512 tokens, so the text encoder's work does not
depend on the words. ``--dtype``: default what the cache picks (bf16 from compute capability 8.0, fp16 below,
fp32 on the CPU). ``--memory-cap-gib``: the process may allocate at most that much GPU memory
(``torch.cuda.set_per_process_memory_fraction``), so a large GPU stands in for a 32 GB V100; ``--attention
efficient`` keeps the VAE's attention (torch SDPA) off flash and cuDNN, which a V100 lacks (memory-efficient,
else math); the text encoder's attention is its own matmuls either way.

Rows: one clip (HxWxF, random pixels), one image (HxW) and one caption, each the median over --runs of one
encode, with the peak memory of each kind (CUDA: max_memory_allocated; CPU: the process's peak RSS). Then the
rows per second of a video row (clip + caption) and of an image row (image + caption). A caption shared by
several rows is encoded once, so a catalogue with repeated captions encodes faster than these rates; the
DataLoader workers decode while the GPU encodes, so decoding is not in these times.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_timing import built_in, refuse_to_start, seconds_of_runs  # noqa: E402

NO_CUDA = ("--full-size needs a CUDA GPU (the umt5-xxl text encoder alone is about 11 GB in bf16); none is "
           "visible here. Run without --full-size for the demo's tiny encoders on this machine.")
CAPTION = "a news anchor in the studio, city street at night"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full-size", action="store_true", help="the Wan2.2 VAE and umt5-xxl at full size (CUDA)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: what the cache picks here")
    parser.add_argument("--height", type=int, help="default 704 with --full-size, else 128")
    parser.add_argument("--width", type=int, help="default 1280 with --full-size, else 128")
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed encodes of each kind first")
    parser.add_argument("--memory-cap-gib", type=float, help="CUDA only: at most this much GPU memory")
    parser.add_argument("--attention", choices=("auto", "efficient"), default="auto",
                        help="efficient: the VAE's SDPA as on a V100 (memory-efficient, else math)")
    parser.add_argument("--json", help="also write the results here")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("runs", "num_frames", "height", "width"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    if (args.num_frames - 1) % 4:
        parser.error(f"--num-frames must be 4k+1 (the VAE's time stride), got {args.num_frames}")
    args.height = args.height or (704 if args.full_size else 128)
    args.width = args.width or (1280 if args.full_size else 128)
    for flag in ("height", "width"):
        if getattr(args, flag) % 32:
            parser.error(f"--{flag} must be a multiple of 32 (the VAE and patch stride), got {getattr(args, flag)}")
    return args


def full_size_encoders(device: str, torch_dtype):
    """The Wan2.2 VAE and umt5-xxl at full size with random weights, built on ``device`` in ``torch_dtype``."""
    from diffsynth.models.wan_video_text_encoder import WanTextEncoder
    from diffsynth.models.wan_video_vae import WanVideoVAE38
    from diffsynth.pipelines.wan_video_new import WanVideoPipeline

    from diffsynth_mbc.data.cache.encoder import ready_to_encode
    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT, demo_tokenizer_in

    pipe = WanVideoPipeline(device=device, torch_dtype=torch_dtype)
    pipe.audio_encoder = pipe.audio_processor = None
    with built_in(torch_dtype, device):   # the cache's dtype
        pipe.vae = WanVideoVAE38()
        pipe.text_encoder = WanTextEncoder()
    pipe.vae.mean, pipe.vae.std = pipe.vae.mean.float(), pipe.vae.std.float()   # as DiffSynth builds them
    pipe.vae.scale = [pipe.vae.mean, 1.0 / pipe.vae.std]
    pipe.prompter.fetch_models(pipe.text_encoder)
    with tempfile.TemporaryDirectory(prefix="mbc-bench-tokenizer-") as folder:   # read while fetching
        pipe.prompter.fetch_tokenizer(str(demo_tokenizer_in(Path(folder))))
    return ready_to_encode(pipe, TI2V_5B_DIT)


def demo_encoders(device: str, torch_dtype):
    from diffsynth_mbc.data.cache.encoder import ready_to_encode
    from diffsynth_mbc.models.pipeline import TINY_DIT, build_demo_pipeline

    return ready_to_encode(build_demo_pipeline(device=device, torch_dtype=torch_dtype), TINY_DIT)


def random_frames(count: int, height: int, width: int, seed: int) -> list:
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(seed)
    return [Image.fromarray(generator.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(count)]


def peak_gib(torch, device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux


def time_kind(torch, device: str, encode, runs: int, warmup: int) -> dict:
    """Median seconds of ``encode()`` over ``runs`` (after ``warmup`` untimed), and the peak memory it reached."""
    for _ in range(warmup):
        encode()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds = seconds_of_runs(encode, runs, lambda: None)   # encode returns CPU tensors: the GPU's work is done
    return {"seconds": round(statistics.median(seconds), 4), "runs": [round(s, 4) for s in seconds],
            "peak_gib": round(peak_gib(torch, device), 2)}


def attention_backends(choice: str):
    import contextlib

    if choice == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def measure(args) -> dict:
    import torch

    from diffsynth_mbc.data.cache.cli import default_dtype
    from diffsynth_mbc.data.cache.encoder import Encoder

    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    dtype_name = args.dtype or default_dtype(torch.cuda.get_device_capability(0) if cuda else None)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    started = time.perf_counter()
    pipe = (full_size_encoders if args.full_size else demo_encoders)(device, torch_dtype)
    built_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="mbc-bench-encode-") as folder:
        encoder = Encoder(pipe, Path(folder), torch_dtype)
        clip = {"video": random_frames(args.num_frames, args.height, args.width, seed=0), "prompt": CAPTION}
        image = {"video": clip["video"][:1], "prompt": CAPTION}
        kinds = {"clip": lambda: encoder.encode_media(clip), "image": lambda: encoder.encode_media(image),
                 "caption": lambda: encoder.encode_text(CAPTION)}
        with attention_backends(args.attention):
            rows = {kind: time_kind(torch, device, encode, args.runs, args.warmup) for kind, encode in kinds.items()}
    video_row = rows["clip"]["seconds"] + rows["caption"]["seconds"]
    image_row = rows["image"]["seconds"] + rows["caption"]["seconds"]
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
            "size": "full" if args.full_size else "demo", "dtype": dtype_name,
            "height": args.height, "width": args.width, "num_frames": args.num_frames,
            "text_len": pipe.prompter.text_len,
            "memory_cap_gib": args.memory_cap_gib, "attention": args.attention, "runs": args.runs, "built_s": round(built_s, 1),
            "rows": [{"kind": kind, **row} for kind, row in rows.items()],
            "video_row_s": round(video_row, 4), "image_row_s": round(image_row, 4),
            "video_rows_per_s": round(1 / video_row, 3), "image_rows_per_s": round(1 / image_row, 3)}


def report(result: dict) -> str:
    size = f"{result['width']}x{result['height']}"
    what = {"clip": f"clip {size}x{result['num_frames']} (VAE: clip + first frame)", "image": f"image {size} (VAE)",
            "caption": f"caption, {result['text_len']} tokens (text encoder)"}
    cap = f", capped at {result['memory_cap_gib']} GiB" if result["memory_cap_gib"] else ""
    cap += ", VAE attention: memory-efficient or math" if result["attention"] == "efficient" else ""
    lines = [f"{result['size']} encoders on {result['device']}, {result['dtype']}{cap} (torch {result['torch']}; "
             f"built in {result['built_s']} s); median of {result['runs']} runs",
             f"{'encode':<48} {'s':>8} {'peak GiB':>9}"]
    lines += [f"{what[row['kind']]:<48} {row['seconds']:>8.4f} {row['peak_gib']:>9.2f}" for row in result["rows"]]
    lines.append(f"video row (clip + caption): {result['video_row_s']:.4f} s, {result['video_rows_per_s']:.3f} rows/s; "
                 f"image row (image + caption): {result['image_row_s']:.4f} s, {result['image_rows_per_s']:.3f} rows/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    refusal = refuse_to_start("bench_encode.py", args.full_size, NO_CUDA, args.memory_cap_gib)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    result = measure(args)
    print(report(result))
    if args.json:
        from diffsynth_mbc.atomic import atomic_write_json

        atomic_write_json(Path(args.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
