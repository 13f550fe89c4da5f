"""Timing the training's own optimizer step, for bench_cache.py.

What is timed is what ``python -m diffsynth_mbc.train`` runs for one optimizer step: the ``Accelerator``
that ``training.accelerator_setup.start_accelerator`` starts (mixed precision resolved by the training's rule, single
process), ``training.step.choices.step_choices`` (blocks that recompute, compiled or not), the
``WanTI2VLoraModule`` the training builds, AdamW over its trainable weights, ``accelerator.prepare`` (which
wraps the forward in autocast and, for fp16, adds the loss scaler), and every step through
``training.step.micro_batch.forward_backward`` (forward, backward, the non-finite check, gradient clipping,
the optimizer step). Gradient accumulation is 1, so one micro-batch is one optimizer step.

A ``Feed`` is a kind of batch (videos or images, so many per forward); several feeds of one setting are timed
in turns, run by run, on the same module, so a loaded machine slows them alike. CUDA timings synchronize.
Memory is measured afterwards, one step per feed: ``torch.cuda.max_memory_allocated`` and ``_reserved``
after emptying the cache, or on the CPU the process's peak RSS sampled every 5 ms; the same step is profiled
to name the attention kernels that ran.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")   # the profiler names kernels; its start/stop lines are noise

# Dense tensor-core peak, bf16 (fp16 on the V100, which has no bf16 units), TFLOP/s.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}
ATTENTION_CHOICES = ("auto", "flash", "cudnn", "efficient", "math")


@dataclass(frozen=True)
class Setting:
    """The choices a training run makes for its step (``--mixed_precision``, ``--gradient_checkpointing``,
    ``--compile``), plus what only a benchmark varies: the SDPA kernels allowed and how the LoRA computes."""
    mixed_precision: str = "auto"
    attention: str = "auto"
    lora_compute: str = "base"
    compile: str = "off"
    gradient_checkpointing: str = "all"
    fp32_residual: str = "auto"   # --fp32_residual: the DiT's residual stream in fp32 (auto: under fp16 and bf16)


@dataclass(frozen=True)
class Feed:
    """``per_forward`` samples of one kind per optimizer step, ``steps_per_run`` steps per timed run."""
    label: str
    kind: str   # "video" or "image"
    per_forward: int
    steps_per_run: int


@dataclass(frozen=True)
class Geometry:
    """Sample sizes as the latent cache stores them: latents 48 x F x H/16 x W/16, text ``text_len x text_dim``."""
    height: int
    width: int
    num_frames: int
    text_len: int
    text_dim: int
    latent_channels: int = 48
    vae_factor: int = 16

    def latent_shape(self, kind: str) -> tuple[int, int, int, int]:
        frames = (self.num_frames - 1) // 4 + 1 if kind == "video" else 1
        return self.latent_channels, frames, self.height // self.vae_factor, self.width // self.vae_factor

    def describe(self, kind: str) -> str:
        frames = self.num_frames if kind == "video" else 1
        return f"{self.width}x{self.height}x{frames}"


class BenchStatus:
    """What the training's status writer is to ``start_accelerator``, ``step_choices`` and the step: fields."""

    def __init__(self):
        self.state = {"world_size": 1, "run_id": "bench"}

    def update(self, **fields) -> None:
        self.state.update(fields)


@dataclass
class StepRun:
    """The training's parts that ``forward_backward`` reads (``training.recipe.Parts``), the step count, and the LoRA
    health whose gradient norms a step may read (none unless a benchmark sets it)."""
    accelerator: object
    module: object
    optimizer: object
    scheduler: object
    trainable: list
    options: argparse.Namespace
    status: BenchStatus
    position: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(step=0))
    health: object = None


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


# ---------------------------------------------------------------------------------------------
# building what the training builds


def training_options(setting: Setting, lora_rank: int) -> argparse.Namespace:
    """The training's defaults (``training.options.DEFAULTS``) with this setting's choices."""
    from diffsynth_mbc.training.options import DEFAULTS

    return argparse.Namespace(**{**DEFAULTS, "mixed_precision": setting.mixed_precision, "lora_rank": lora_rank,
                                 "gradient_checkpointing": setting.gradient_checkpointing,
                                 "compile": setting.compile, "fp32_residual": setting.fp32_residual})


def random_dit_pipeline(dit_config: dict):
    """A factory (device, dtype) -> WanVideoPipeline holding only a randomly initialised DiT of ``dit_config``."""
    def make(device, dtype):
        import torch
        from diffsynth.models.wan_video_dit import WanModel
        from diffsynth.pipelines.wan_video_new import WanVideoPipeline

        pipe = WanVideoPipeline(device=str(device), torch_dtype=dtype)
        pipe.audio_encoder = pipe.audio_processor = None
        with torch.device(device):
            dit = WanModel(**dit_config)
        pipe.dit = dit.to(dtype=dtype)
        return pipe
    return make


def build_step_run(setting: Setting, make_pipe, lora_rank: int) -> tuple[StepRun, dict]:
    """Accelerator, model, LoRA module, AdamW and accelerate's prepare, as ``training.recipe`` does them."""
    import torch

    from diffsynth_mbc.training.distributed.accelerator import start_accelerator
    from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
    from diffsynth_mbc.training.step.micro_batch import adamw
    from diffsynth_mbc.training.plan.step_choices import residual_choice, step_choices

    options = training_options(setting, lora_rank)
    status = BenchStatus()
    accelerator = start_accelerator(options, status)
    torch.manual_seed(options.seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    pipe = make_pipe(accelerator.device, dtype)
    dit_parameters = sum(p.numel() for p in pipe.dit.parameters())
    recompute, compile_blocks = step_choices(options, status, accelerator, len(pipe.dit.blocks))
    module = WanTI2VLoraModule(
        pipe, lora_target_modules=options.lora_target_modules, lora_rank=options.lora_rank,
        lora_alpha=options.lora_alpha, use_gradient_checkpointing=options.use_gradient_checkpointing,
        max_timestep_boundary=options.max_timestep_boundary, min_timestep_boundary=options.min_timestep_boundary,
        recompute_blocks=recompute, compile_blocks=compile_blocks, lora_compute=setting.lora_compute,
        fp32_residual=residual_choice(options, status, accelerator.mixed_precision))
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = adamw(trainable, options.learning_rate, options.weight_decay)
    module, optimizer = accelerator.prepare(module, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)   # the constant schedule
    torch.manual_seed(options.seed + 1000 * accelerator.process_index)
    run = StepRun(accelerator=accelerator, module=module, optimizer=optimizer, scheduler=scheduler,
                  trainable=trainable, options=options, status=status)
    info = {"device": device_name(accelerator.device), "torch": torch.__version__,
            "mixed_precision": accelerator.mixed_precision, "model_dtype": str(dtype).replace("torch.", ""),
            "precision_reason": status.state.get("precision_reason"),
            "expected_attention_kernel": status.state.get("attention_kernel"),
            "dit_attention_path": dit_attention_path(), "recompute_blocks": recompute,
            "num_blocks": len(pipe.dit.blocks), "gradient_checkpointing_reason":
            status.state.get("gradient_checkpointing_reason"), "compile_reason": status.state.get("compile_reason"),
            "lora_compute": setting.lora_compute, "lora_rank": lora_rank,
            "fp32_residual": status.state.get("fp32_residual"),
            "lora_parameters": sum(p.numel() for p in trainable), "dit_parameters": dit_parameters,
            "dit_layers": len(pipe.dit.blocks), "dit_dim": pipe.dit.dim}
    return run, info


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def dit_attention_path() -> str:
    """What DiffSynth's DiT calls for attention: an installed flash-attn or SageAttention wins over torch's
    SDPA, and then the SDPA kernel choice (``--attention``) has no effect."""
    import diffsynth.models.wan_video_dit as wan

    if wan.FLASH_ATTN_3_AVAILABLE:
        return "flash_attn 3 (package; SDPA not used)"
    if wan.FLASH_ATTN_2_AVAILABLE:
        return "flash_attn 2 (package; SDPA not used)"
    if wan.SAGE_ATTN_AVAILABLE:
        return "sageattention (package; SDPA not used)"
    return "torch SDPA"


@contextlib.contextmanager
def built_in(dtype, device: str):
    """Modules built inside this are made on ``device`` in ``dtype`` directly: no fp32 copy of billions of
    parameters first."""
    import torch

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default_dtype)


def seconds_of_runs(work, runs: int, sync) -> list[float]:
    """Wall seconds of each of ``runs`` calls of ``work``, each ended by ``sync`` (CUDA's synchronize: the GPU's
    work counted, not only its launch)."""
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def refuse_to_start(script: str, full_size: bool, no_cuda: str, memory_cap_gib: float | None) -> str | None:
    """What a benchmark prints and exits 2 on before it measures anything: ``no_cuda`` for a full-size run without a
    CUDA GPU, a memory cap without one; None to go on (the cap then set)."""
    import torch

    if full_size and not torch.cuda.is_available():
        return no_cuda
    return cap_cuda_memory(memory_cap_gib, script)


def cap_cuda_memory(gib: float | None, script: str) -> str | None:
    """``--memory-cap-gib``: this process may allocate at most ``gib`` GiB of GPU memory (an allocation past it fails
    as it would on a smaller GPU). The refusal to print when no CUDA GPU is visible, else None."""
    if gib is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return f"{script}: --memory-cap-gib caps CUDA memory; no CUDA GPU is visible here"
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))
    return None


def attention_backends(choice: str):
    """``torch.nn.attention.sdpa_kernel`` restricted to one SDPA backend; ``auto`` leaves torch's choice."""
    if choice == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[choice]
    return sdpa_kernel([backend])


# ---------------------------------------------------------------------------------------------
# samples


def cache_like_entries(geometry: Geometry, kind: str, count: int, dtype, seed: int = 0) -> list[dict]:
    """``count`` samples shaped as ``CachedLatentDataset`` yields them, random latents and text embedding,
    on the CPU in the cache's dtype (the step moves them to the GPU, as in training)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    entries = []
    for index in range(count):
        latents = torch.randn(geometry.latent_shape(kind), generator=generator).to(dtype)
        context = torch.randn((geometry.text_len, geometry.text_dim), generator=generator).to(dtype)
        entries.append({"cached": True, "input_latents": latents, "first_frame_latents": latents[:, :1].clone(),
                        "context": context, "prompt": f"benchmark {kind} {index}", "media_type": kind,
                        "height": geometry.height, "width": geometry.width,
                        "num_frames": geometry.num_frames if kind == "video" else 1})
    return entries


class Batches:
    """Each feed's next batch, cycling through the samples of its kind (``pools[kind]``: a list or dataset)."""

    def __init__(self, pools: dict):
        self.pools = pools
        self.next = {}

    def __call__(self, feed: Feed) -> list[dict]:
        pool = self.pools[feed.kind]
        start = self.next.get(feed.label, 0)
        self.next[feed.label] = start + feed.per_forward
        return [pool[(start + i) % len(pool)] for i in range(feed.per_forward)]


# ---------------------------------------------------------------------------------------------
# timing


def optimizer_step(run: StepRun, batch: list[dict], around_forward=contextlib.nullcontext) -> bool:
    """One optimizer step through the training's ``forward_backward``; True when it was skipped (non-finite).
    ``around_forward()``: a context the module's forward runs in (a profiler's window)."""
    from diffsynth_mbc.training.step.micro_batch import forward, forward_backward

    def on_gradients(grad_norm, max_norm):
        if run.health is not None:
            run.health.on_gradients(run.position.step + 1, grad_norm, max_norm)

    def loss_of(each):
        with around_forward():
            return forward(run.module, run.accelerator, run.status, each)

    step = forward_backward(run, batch, [], loss_of, on_gradients)
    run.position.step += 1
    return step.skipped


def print_and_save(text: str, result: dict, json_path: str | None) -> None:
    """A benchmark's last words: its report printed, its result written to ``json_path`` (when given)."""
    print(text)
    if json_path:
        from diffsynth_mbc.atomic import atomic_write_json
        atomic_write_json(Path(json_path), result, indent=1)


def time_feeds(run: StepRun, feeds: list[Feed], batches: Batches, warmup: int, runs: int, attention: str) -> dict:
    """Per feed: seconds of its warm-up steps, mean s/step of each run, skipped steps, memory and attention kernels
    of one more step."""
    import torch

    cuda = run.accelerator.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results = {feed.label: {"s_per_step_runs": [], "skipped_steps": 0, "timed_steps": 0} for feed in feeds}
    with attention_backends(attention):
        for feed in feeds:   # the first feed's warm-up compiles (with --compile), the others' reuse or recompile
            start = time.perf_counter()
            for _ in range(warmup):
                optimizer_step(run, batches(feed))
            sync()
            results[feed.label]["warmup_s"] = time.perf_counter() - start
        for _ in range(runs):
            for feed in feeds:   # in turns, so a busy machine slows every feed alike
                result = results[feed.label]
                start = time.perf_counter()
                for _ in range(feed.steps_per_run):
                    result["skipped_steps"] += optimizer_step(run, batches(feed))
                sync()
                result["s_per_step_runs"].append((time.perf_counter() - start) / feed.steps_per_run)
                result["timed_steps"] += feed.steps_per_run
        for feed in feeds:
            results[feed.label].update(memory_and_kernels(run, batches(feed), cuda))
    return results


def memory_and_kernels(run: StepRun, batch: list[dict], cuda: bool) -> dict:
    """One more step: its peak memory, and which attention kernels the profiler saw."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as rss, profile(activities=[ProfilerActivity.CPU]) as profiler:
        optimizer_step(run, batch)
        if cuda:
            torch.cuda.synchronize()
    kernels = sorted({attention_kernel_name(event.key) for event in profiler.key_averages()} - {None})
    memory = {"peak_rss_mib": rss.peak / 2**20}
    if cuda:
        memory.update(max_memory_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                      max_memory_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
    return {**memory, "attention_kernels": kernels or ["none seen (compiled into the graph, or not SDPA)"]}


def attention_kernel_name(op: str) -> str | None:
    """The SDPA backend an aten op belongs to, or None for other ops."""
    op = op.lower()
    if "scaled_dot_product" not in op and "_attention" not in op:
        return None
    for key, name in (("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "efficient"), ("math", "math")):
        if key in op:
            return name
    return None


# ---------------------------------------------------------------------------------------------
# figures


def dit_flops_per_sample(parameters: int, tokens: int, layers: int, dim: int, text_len: int) -> float:
    """6 P T + 12 L d T^2 + 12 L d T S: the usual forward+backward matmul count, plus self- and cross-attention."""
    return 6.0 * parameters * tokens + 12.0 * layers * dim * tokens ** 2 + 12.0 * layers * dim * tokens * text_len


def peak_flops(device: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    for key, tflops in PEAK_TFLOPS.items():
        if key in device:
            return tflops * 1e12
    return None


def summarise(feed: Feed, timed: dict, tokens_per_sample: int, info: dict, text_len: int, peak: float | None) -> dict:
    """Median over runs of the mean s/step, and the throughputs and MFU that follow from it."""
    s_per_step = statistics.median(timed["s_per_step_runs"])
    tokens = feed.per_forward * tokens_per_sample
    flops = feed.per_forward * dit_flops_per_sample(info["dit_parameters"], tokens_per_sample, info["dit_layers"],
                                                    info["dit_dim"], text_len)
    return {"label": feed.label, "kind": feed.kind, "samples_per_step": feed.per_forward, "tokens_per_step": tokens,
            **timed, "s_per_step": s_per_step, "samples_per_s": feed.per_forward / s_per_step,
            "tokens_per_s": tokens / s_per_step, "dit_flops_per_step": flops,
            "mfu": flops / (s_per_step * peak) if peak else None}
