"""Seconds per optimizer step: encoding every step (VAE + T5 + DiT) vs training the DiT from the latent cache.

CPU, the tiny random TI2V-architecture demo model (always available; real mp4 clips at 128x128x17 so the
encoding cost shows):

    python benchmarks/bench_cache.py [--height 128 --width 128 --num-frames 17 --runs 5 --steps 4]

GPU, Wan2.2-TI2V-5B at full size with random weights (DiT from pipeline.TI2V_5B_DIT, WanVideoVAE38(),
WanTextEncoder() at their default dimensions, no downloads), 1280x704x17, bf16, LoRA rank 32:

    python benchmarks/bench_cache.py --full-size [--runs 5 --steps 5 --peak-tflops 989]

CPU mode: builds the demo catalogue and its cache (``python -m diffsynth_mbc.cache``'s ``main``, timed as the
one-off encoding cost), then measures each path in its own process so that peak memory is that path's
alone: ``encode`` = MBCVideoDataset (decode) + the pipeline units + DiT, with VAE and text encoder loaded;
``cached`` = CachedLatentDataset (read safetensors) + DiT, with neither encoder loaded. Batch size 1,
AdamW, gradient checkpointing on (the training defaults). Each path: ``--warmup`` steps, then ``--runs``
runs of ``--steps`` optimizer steps; reported: the median over runs of the mean s/step, samples/s, the
encode/cached ratio, and the peak RSS sampled during the steps (psutil, every 5 ms).

Full-size mode needs CUDA (it refuses otherwise). Both paths in one process: the encode path first with
everything on the GPU, then the encoders are freed and the cached path runs on inputs made by those same
encoders. Memory is torch.cuda.max_memory_allocated per path. MFU counts the DiT's training FLOPs only:

    FLOPs/step = 6 * P * T  +  12 * L * d * T^2  +  12 * L * d * T * S

P = DiT parameters (LoRA excluded), T = video tokens = latent frames x (H/32) x (W/32) (4,400 at 1280x704x17),
L = 30 layers, d = 3072, S = 512 text positions; 6PT is the usual forward+backward matmul count, the other
terms are self- and cross-attention (QK^T and AV, forward x3 for training). LoRA skips weight gradients of
the frozen base and gradient checkpointing recomputes the forward, so the hardware does roughly (4+2)PT:
the 6PT convention is kept for comparability. MFU = FLOPs/step / (s/step x peak bf16 FLOP/s); the peak is
looked up from the device name or given with --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0,
                    "V100": 125.0}   # V100: fp16 tensor cores; it has no bf16 units


class PeakRSS:
    """Highest resident set size of this process while the block runs (sampled every ``interval`` s)."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self.process = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def timed_steps(module, optimizer, next_sample, warmup: int, runs: int, steps: int, sync=lambda: None) -> dict:
    """Per run: mean seconds per optimizer step (data + model) and the model part alone."""
    import torch

    def one_step():
        start = time.perf_counter()
        sample = next_sample()
        loaded = time.perf_counter()
        loss = module([sample])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        end = time.perf_counter()
        return end - start, end - loaded

    torch.manual_seed(0)
    for _ in range(warmup):
        one_step()
    totals, models = [], []
    for _ in range(runs):
        times = [one_step() for _ in range(steps)]
        totals.append(sum(t for t, _ in times) / steps)
        models.append(sum(m for _, m in times) / steps)
    return {"s_per_step_runs": totals, "s_per_step": statistics.median(totals),
            "model_s_per_step": statistics.median(models), "samples_per_s": 1.0 / statistics.median(totals)}


# ---------------------------------------------------------------------------------------------
# CPU: the tiny demo model


def prepare_cpu_data(root: Path, args) -> dict:
    from diffsynth_mbc.data.cache import cli as cache
    from diffsynth_mbc.data import convert
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


def cpu_worker(args) -> dict:
    import torch

    from diffsynth_mbc.data.cache.dataset import CachedLatentDataset
    from diffsynth_mbc.data.dataset import MBCVideoDataset
    from diffsynth_mbc.models.pipeline import build_demo_pipeline
    from diffsynth_mbc.training.lora_module import WanTI2VLoraModule

    root = Path(args.data)
    cached = args.worker == "cached"
    pipe = build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=42, load_encoders=not cached,
                               tokenizer_dir=str(root / ".tokenizer"))
    torch.manual_seed(0)
    module = WanTI2VLoraModule(pipe, lora_rank=args.lora_rank)
    if cached:
        dataset = CachedLatentDataset(root / "cache")
    else:
        dataset = MBCVideoDataset(str(root / "catalog"), str(root / "metadata" / "metadata.csv"),
                                  num_frames=args.num_frames, height=args.height, width=args.width)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    counter = iter(range(10**9))

    def next_sample():
        return dataset[next(counter) % len(dataset)]

    models_loaded = {name: sum(p.numel() for p in getattr(pipe, name).parameters())
                     for name in ("dit", "vae", "text_encoder") if getattr(pipe, name) is not None}
    with PeakRSS() as rss:
        result = timed_steps(module, optimizer, next_sample, args.warmup, args.runs, args.steps)
    import resource

    return {**result, "path": args.worker, "peak_rss_mib_during_steps": rss.peak / 2**20,
            "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "parameters_loaded": models_loaded, "threads": torch.get_num_threads()}


def run_cpu(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as folder:
        root = Path(folder)
        summary = prepare_cpu_data(root, args)
        results = {}
        for path in ("encode", "cached"):
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", path, "--data", str(root),
                       "--height", str(args.height), "--width", str(args.width), "--num-frames", str(args.num_frames),
                       "--runs", str(args.runs), "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--lora-rank", str(args.lora_rank)]
            child = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if child.returncode != 0:
                raise RuntimeError(f"{path} worker failed:\n{child.stderr[-3000:]}")
            results[path] = json.loads(child.stdout.strip().splitlines()[-1])
    return {"mode": f"cpu, tiny demo model, {args.width}x{args.height}x{args.num_frames} (W x H x frames), fp32, "
                    f"batch 1, LoRA rank {args.lora_rank}", "cache": summary, **results,
            "ratio_encode_over_cached": results["encode"]["s_per_step"] / results["cached"]["s_per_step"]}


# ---------------------------------------------------------------------------------------------
# GPU: Wan2.2-TI2V-5B at full size, random weights


def dit_flops_per_step(parameters: int, tokens: int, layers: int = 30, dim: int = 3072, text_len: int = 512) -> float:
    return 6.0 * parameters * tokens + 12.0 * layers * dim * tokens ** 2 + 12.0 * layers * dim * tokens * text_len


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return None


def run_full_size(args, device: str = "cuda", dtype=None, size: tuple[int, int, int] = (704, 1280, 17),
                  dit_config: dict | None = None, vae_factory=None, text_encoder_factory=None) -> dict:
    """The full-size comparison; the keyword arguments exist only to dry-run this code small."""
    import numpy as np
    import torch
    from PIL import Image

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--full-size needs a CUDA GPU with about 48 GB free (DiT 5B + UMT5-XXL + Wan2.2 VAE, "
                         "built in fp32 then cast to bf16); none is visible here. Run without --full-size for "
                         "the CPU comparison.")
    from diffsynth.models.wan_video_dit import WanModel
    from diffsynth.models.wan_video_text_encoder import WanTextEncoder
    from diffsynth.models.wan_video_vae import WanVideoVAE38
    from diffsynth.pipelines.wan_video_new import WanVideoPipeline

    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT, _write_demo_tokenizer
    from diffsynth_mbc.training.lora_module import WanTI2VLoraModule

    dtype = dtype or torch.bfloat16
    height, width, num_frames = size
    dit_config = dit_config or TI2V_5B_DIT
    vae_factory = vae_factory or WanVideoVAE38
    text_encoder_factory = text_encoder_factory or WanTextEncoder
    on_gpu = device.startswith("cuda")
    torch.manual_seed(0)

    def build(factory):
        with torch.device(device):
            model = factory()
        return model.to(dtype=dtype).eval().requires_grad_(False)

    pipe = WanVideoPipeline(device=device, torch_dtype=dtype)
    pipe.dit = build(lambda: WanModel(**dit_config))
    dit_parameters = sum(p.numel() for p in pipe.dit.parameters())
    pipe.vae = build(vae_factory)
    pipe.text_encoder = build(text_encoder_factory)
    with tempfile.TemporaryDirectory(prefix="bench-tokenizer-") as folder:
        _write_demo_tokenizer(Path(folder))
        pipe.prompter.fetch_models(pipe.text_encoder)
        pipe.prompter.fetch_tokenizer(folder)
    pipe.height_division_factor = pipe.width_division_factor = pipe.vae.upsampling_factor * 2
    module = WanTI2VLoraModule(pipe, lora_rank=args.lora_rank)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)

    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(num_frames)]
    caption = " ".join(["news anchor in the studio of the city at night"] * 6)
    clip = {"video": frames, "prompt": caption}
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def reset_memory():
        if on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_memory_gib():
        return torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")

    reset_memory()
    encode = timed_steps(module, optimizer, lambda: clip, args.warmup, args.runs, args.steps, sync)
    encode["max_memory_allocated_gib"] = peak_memory_gib()

    # The cached inputs, made by the same encoders (what the cache would hold), then the encoders go.
    inputs = module.encode(clip)
    tokens_real = int(inputs["context"][0].abs().sum(dim=-1).gt(0).sum())
    cached_sample = {"cached": True, "prompt": caption, "height": height, "width": width, "num_frames": num_frames,
                     "input_latents": inputs["input_latents"][0].cpu(),
                     "first_frame_latents": inputs["first_frame_latents"][0].cpu(),
                     "context": inputs["context"][0].cpu()}
    latent_shape = list(cached_sample["input_latents"].shape)
    del inputs
    pipe.vae = None
    pipe.text_encoder = None
    pipe.prompter.fetch_models(None)
    reset_memory()
    cached = timed_steps(module, optimizer, lambda: cached_sample, args.warmup, args.runs, args.steps, sync)
    cached["max_memory_allocated_gib"] = peak_memory_gib()

    tokens = latent_shape[1] * (latent_shape[2] // 2) * (latent_shape[3] // 2)
    flops = dit_flops_per_step(dit_parameters, tokens, layers=dit_config["num_layers"], dim=dit_config["dim"],
                               text_len=pipe.prompter.text_len)
    name = torch.cuda.get_device_name() if on_gpu else device
    peak = peak_flops(name, args.peak_tflops)
    for result in (encode, cached):
        result["mfu"] = flops / (result["s_per_step"] * peak) if peak else None
    return {"mode": f"{name}, Wan2.2-TI2V-5B random weights, {width}x{height}x{num_frames}, {dtype}, batch 1, "
                    f"LoRA rank {args.lora_rank}",
            "dit_parameters": dit_parameters, "video_tokens": tokens, "latent_shape": latent_shape,
            "caption_tokens": tokens_real, "dit_flops_per_step": flops,
            "peak_flops": peak, "encode": encode, "cached": cached,
            "ratio_encode_over_cached": encode["s_per_step"] / cached["s_per_step"]}


# ---------------------------------------------------------------------------------------------


def report(result: dict) -> str:
    lines = [f"mode: {result['mode']}"]
    if "cache" in result:
        summary = result["cache"]
        load = sum(rank["model_load_seconds"] for rank in summary["per_rank"])
        lines.append(f"cache build: {summary['rows_cached']} clips in {summary['seconds']:.1f} s, of which "
                     f"{load:.1f} s building the encoders "
                     f"({(summary['seconds'] - load) / max(summary['rows_cached'], 1):.2f} s/clip after that), "
                     f"{summary['bytes_per_sample']} bytes/sample measured; projected 1280x704x17 bf16: "
                     f"{summary['projected_1280x704x17_bf16']['mib']:.3f} MiB/sample "
                     f"(mean {summary['mean_text_tokens']} caption tokens)")
    lines.append(f"{'path':<8} {'s/step':>9} {'model s':>9} {'samples/s':>10} {'memory':>14}  runs (s/step)")
    for path in ("encode", "cached"):
        item = result[path]
        memory = (f"{item['peak_rss_mib_during_steps']:.0f} MiB RSS" if "peak_rss_mib_during_steps" in item
                  else f"{item['max_memory_allocated_gib']:.1f} GiB GPU")
        mfu = f"  MFU {item['mfu'] * 100:.1f}%" if item.get("mfu") is not None else ""
        lines.append(f"{path:<8} {item['s_per_step']:>9.4f} {item['model_s_per_step']:>9.4f} "
                     f"{item['samples_per_s']:>10.2f} {memory:>14}  "
                     + " ".join(f"{t:.4f}" for t in item["s_per_step_runs"]) + mfu)
    lines.append(f"encode-every-step / cached: {result['ratio_encode_over_cached']:.1f}x s/step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--num-frames", type=int, default=17)
    parser.add_argument("--rows", type=int, default=4, help="clips in the CPU catalogue (cycled through)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--full-size", action="store_true", help="Wan2.2-TI2V-5B dimensions on a CUDA GPU")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's peak bf16 TFLOP/s for MFU")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", choices=("encode", "cached"), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(cpu_worker(args)))
        return 0
    result = run_full_size(args) if args.full_size else run_cpu(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
