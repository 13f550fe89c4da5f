"""Every row of a GPU's step table, and what evaluation costs, on the training's own step in one process per setting.

    python benchmarks/bench_rows.py --full-size --setting default --extras --json default.json
    python benchmarks/bench_rows.py --full-size --setting recompute_all --json recompute_all.json
    python benchmarks/bench_rows.py --full-size --setting v100_analog --json v100_analog.json
    python benchmarks/bench_rows.py --full-size --setting static_reference --json static_reference.json
    python benchmarks/bench_rows.py --full-size --setting static_reference --rows one_image --json static_one_image.json
    python benchmarks/bench_rows.py --full-size --setting dora_health --json dora_health.json
    python benchmarks/bench_rows.py [--setting default --extras]      # the tiny DiT on this machine (CPU)

A row is a kind of batch a run trains (``ROWS``): the presets' clip (``default``, 1280x704x17), a portrait
clip's bucket (704x1280x17), five 1280x704 images in one forward (the default image batch), one image (a
partial batch), five 960x960 images (a square bucket), a low-resolution stage's clip (832x480x17) and clips that
alternate i2v and t2v (``--i2v_probability 0.5``: the t2v clip takes the DiT's per-sample time modulation, the
i2v clip its per-token one). A setting (``SETTINGS``) is the step's choices: ``default`` is what the presets
train on this GPU (``--mixed_precision``, ``--compile`` and ``--gradient_checkpointing`` auto);
``recompute_all`` every block recomputed; ``v100_analog`` the V100's path on this GPU (fp16 with loss scaling,
memory-efficient attention, 10 of 30 blocks recomputed, 30 GiB); ``static_reference`` the default step on the
presets' clip alone, so its compiled graph never sees another shape (the step as it was timed before buckets).

All rows of a setting run in one process on one model, as one rank of a run trains every bucket of its
catalogue: each row's warm-up steps first, in the table's order (the compiled blocks meet each shape and mode
there: the graphs Dynamo compiled during each warm-up are counted), then ``--runs`` runs of ``--steps`` steps of
every row in turns, then one more step per row for its peak memory (``max_memory_allocated``) and attention
kernels. What is timed is ``step_timing``'s: the training's Accelerator, LoRA module, AdamW and
``forward_backward``.

``--extras`` (with the default setting), on the same module after the rows:

- ``health_record_s``: one LoRA health record as the training makes it (``LoraHealth.record`` after a step whose
  blocks' gradient norms it read), the median of 3;
- ``val_sample_s``: one validation sample at the five timestep quantiles, with the LoRA and with the base
  (``Validator.measure_losses``, then under ``lora_disabled``), median of 3 after one untimed (compiling) pass;
- ``sample_clip_s``: one 1280x704x17 clip (``--sample-size`` WxHxF) at the default sampling steps and CFG
  (``sample_prompts.DEFAULT_STEPS``, ``DEFAULT_CFG``) through the training's ``Sampler`` and DiffSynth's pipeline
  (a full-size Wan2.2 VAE with random weights; the prompts' embeddings random, as a cached run takes them from
  the cache), after one untimed 2-step clip that compiles the blocks' no-grad graph and warms the VAE; the mp4
  is not written (no encoder is needed to time the render);
- the graphs compiled by the validation and the sampling.

``dora_health``: a full-size DiT with DoRA (``add_dora``, rank 32 on the presets' targets) and one health record
of it (exact norms, the base weights read in fp64 row chunks), median of 3 after one untimed; no step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_timing import (Feed, Geometry, Setting, attention_backends, build_step_run, built_in,  # noqa: E402
                         cache_like_entries, memory_and_kernels, optimizer_step, peak_flops, print_and_save,
                         random_dit_pipeline, refuse_to_start, seconds_of_runs, summarise)

NO_CUDA = "--full-size needs a CUDA GPU; none is visible here. Run without --full-size for the tiny DiT."


@dataclasses.dataclass(frozen=True)
class Row:
    kind: str            # "video" or "image"
    width: int
    height: int
    num_frames: int
    per_forward: int
    modes: tuple = ()    # the samples' modes in turn (empty: each kind's default, i2v for a clip)


# The full-size rows; the tiny ones are the same shapes at a tenth of the sides (multiples of 32) and 5 frames.
ROWS = {
    "default": Row("video", 1280, 704, 17, 1),
    "portrait": Row("video", 704, 1280, 17, 1),
    "image_batch": Row("image", 1280, 704, 1, 5),
    "one_image": Row("image", 1280, 704, 1, 1),
    "square_images": Row("image", 960, 960, 1, 5),
    "stage_low": Row("video", 832, 480, 17, 1),
    "mixed_modes": Row("video", 1280, 704, 17, 1, modes=("i2v", "t2v")),
}
AUTO = {"mixed_precision": "auto", "attention": "auto", "compile": "auto", "gradient_checkpointing": "auto"}
# setting -> (the step's choices, its rows, GiB the process may allocate)
SETTINGS = {
    "default": (AUTO, tuple(ROWS), None),
    "recompute_all": ({**AUTO, "gradient_checkpointing": "all"}, ("default", "one_image", "image_batch"), None),
    "v100_analog": ({**AUTO, "mixed_precision": "fp16", "attention": "efficient", "gradient_checkpointing": "10"},
                    ("default", "one_image", "image_batch"), 30.0),
    "static_reference": (AUTO, ("default",), None),
    "dora_health": (AUTO, (), None),
}


def sized(row: Row, full_size: bool) -> Row:
    if full_size:
        return row
    side = lambda pixels: max(32, round(pixels / 10 / 32) * 32)  # noqa: E731
    return dataclasses.replace(row, width=side(row.width), height=side(row.height),
                               num_frames=5 if row.kind == "video" else 1,
                               per_forward=2 if row.per_forward > 1 else 1)


def text_shape(full_size: bool) -> tuple[int, int]:
    from diffsynth_mbc.models.pipeline import TINY_DIT, TINY_TEXT_LEN

    return (512, 4096) if full_size else (TINY_TEXT_LEN, TINY_DIT["text_dim"])


def row_samples(name: str, row: Row, full_size: bool, dtype, seed: int) -> list[dict]:
    geometry = Geometry(row.height, row.width, row.num_frames, *text_shape(full_size))
    count = max(2, row.per_forward, len(row.modes))
    entries = cache_like_entries(geometry, row.kind, count, dtype, seed=seed)
    for index, entry in enumerate(entries):
        entry["prompt"] = f"benchmark {name} {index}"
        if row.modes:
            entry["mode"] = row.modes[index % len(row.modes)]
    return entries


def dynamo_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (each compiled block's shape, mode and grad state)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def median_of(work, runs: int, sync) -> tuple[float, list[float]]:
    times = seconds_of_runs(work, runs, sync)
    return statistics.median(times), times


# ---------------------------------------------------------------------------------------------
# the rows


def time_rows(run, rows: dict, pools: dict, args, sync) -> dict:
    """Warm-up of every row (graphs compiled, seconds), then the runs in turns, then memory per row."""
    feeds = {name: Feed(name, name, row.per_forward, args.steps) for name, row in rows.items()}
    cursor = {name: 0 for name in rows}

    def batch(name):
        pool, start = pools[name], cursor[name]
        cursor[name] = start + rows[name].per_forward
        return [dict(pool[(start + i) % len(pool)]) for i in range(rows[name].per_forward)]

    timed = {name: {"s_per_step_runs": [], "skipped_steps": 0, "timed_steps": 0} for name in rows}
    for name in rows:
        graphs, start = dynamo_graphs(), time.perf_counter()
        for _ in range(args.warmup):
            optimizer_step(run, batch(name))
        sync()
        timed[name].update(warmup_s=time.perf_counter() - start, graphs_compiled=dynamo_graphs() - graphs)
        print(f"  {name}: warm-up {timed[name]['warmup_s']:.1f} s, {timed[name]['graphs_compiled']} graph(s) "
              "compiled", file=sys.stderr, flush=True)
    graphs = dynamo_graphs()
    for _ in range(args.runs):
        for name in rows:
            start = time.perf_counter()
            for _ in range(args.steps):
                timed[name]["skipped_steps"] += optimizer_step(run, batch(name))
            sync()
            timed[name]["s_per_step_runs"].append((time.perf_counter() - start) / args.steps)
            timed[name]["timed_steps"] += args.steps
    graphs_while_timed = dynamo_graphs() - graphs
    cuda = run.accelerator.device.type == "cuda"
    for name in rows:
        samples = batch(name)
        timed[name].update(memory_and_kernels(run, samples, cuda),
                           memory_step_modes=[sample.get("mode") for sample in samples if sample.get("mode")])
    return {"feeds": feeds, "timed": timed, "graphs_while_timed": graphs_while_timed}


# ---------------------------------------------------------------------------------------------
# the extras


def health_record_seconds(run, batch, runs: int) -> dict:
    """One LoRA health record as the training takes it: the blocks' gradient norms read inside a step, the update
    norms after it (``LoraHealth.record``'s ``seconds``)."""
    from diffsynth_mbc.training.distributed.accelerator import unwrapped_model
    from diffsynth_mbc.training.components.lora_health import LoraHealth

    blocks = unwrapped_model(run.accelerator, run.module).pipe.dit.blocks
    health = LoraHealth(blocks, SimpleNamespace(history_listeners=[]), None, every=1, total_steps=10 ** 9,
                        warmup_steps=0)
    run.health, seconds = health, []
    try:
        for _ in range(runs + 1):
            optimizer_step(run, batch())
            seconds.append(health.record(run.position.step, write=False)["seconds"])
    finally:
        run.health = None
    return {"health_record_s": statistics.median(seconds[1:]), "health_record_s_runs": seconds[1:],
            "health_record_first_s": seconds[0]}


def validation_seconds(run, sample: dict, runs: int, sync) -> dict:
    """One validation sample at the default five quantiles, LoRA and base, through the training's Validator."""
    from diffsynth_mbc.training.distributed.accelerator import unwrapped_model
    from diffsynth_mbc.training.evaluation.validation import Validator
    from diffsynth_mbc.training.options import DEFAULTS

    validator = Validator.__new__(Validator)   # its dataset: this one sample (no catalogue to open here)
    validator.status, validator.seed, validator.dataset, validator.indices = run.status, 7919, [sample], [0]
    validator.quantiles = list(DEFAULTS["val_timestep_quantiles"])
    validator.objective, validator.i2v_probability = DEFAULTS["objective"], DEFAULTS["i2v_probability"]
    validator.validate_with, validator.ema, validator.base = "raw", None, None
    validator.attach(run.accelerator, run.module)
    model = unwrapped_model(run.accelerator, run.module)

    def lora_and_base():
        validator.measure_losses()
        with model.lora_disabled():
            validator.measure_losses()

    graphs, start = dynamo_graphs(), time.perf_counter()
    lora_and_base()
    sync()
    first = time.perf_counter() - start
    seconds, each = median_of(lora_and_base, runs, sync)
    lora, _ = median_of(validator.measure_losses, runs, sync)
    return {"val_sample_s": seconds, "val_sample_s_runs": each, "val_sample_lora_s": lora,
            "val_quantiles": len(validator.quantiles), "val_first_s": first,
            "val_graphs_compiled": dynamo_graphs() - graphs}


def add_vae(pipe, full_size: bool) -> None:
    """A Wan2.2 VAE with random weights (full size, or the demo's narrow one) on the pipeline, as DiffSynth's
    loader sets it up, for rendering."""
    from diffsynth.models.wan_video_vae import WanVideoVAE38

    from diffsynth_mbc.models.pipeline import build_tiny_vae

    with built_in(pipe.torch_dtype, str(pipe.device)):
        pipe.vae = WanVideoVAE38() if full_size else build_tiny_vae()
    pipe.vae.mean, pipe.vae.std = pipe.vae.mean.float(), pipe.vae.std.float()
    pipe.vae.scale = [pipe.vae.mean, 1.0 / pipe.vae.std]
    pipe.height_division_factor = pipe.width_division_factor = 32


def sample_clip_seconds(run, size: tuple[int, int, int], full_size: bool, sync) -> dict:
    """One clip through the training's Sampler (``_generate_all``: eval mode, no grad, the scheduler restored),
    at the default sampling steps and CFG, after an untimed 2-step clip; the mp4 writer is left out."""
    import torch

    from diffsynth_mbc.sample_prompts import DEFAULT_CFG, DEFAULT_STEPS, SamplePrompt
    from diffsynth_mbc.training.distributed.accelerator import unwrapped_model
    from diffsynth_mbc.training.evaluation.sample_clips import Sampler
    from diffsynth_mbc.training.options import DEFAULTS

    pipe = unwrapped_model(run.accelerator, run.module).pipe
    add_vae(pipe, full_size)
    width, height, frames = size
    text_len, text_dim = text_shape(full_size)
    generator = torch.Generator().manual_seed(5)
    contexts = {text: torch.randn((text_len, text_dim), generator=generator).to(pipe.torch_dtype)
                for text in ("a news anchor in a studio", "")}
    result = {"sample_size": f"{width}x{height}x{frames}", "sample_steps": DEFAULT_STEPS, "sample_cfg": DEFAULT_CFG}
    with tempfile.TemporaryDirectory(prefix="mbc-bench-samples-") as folder:
        options = SimpleNamespace(**{**DEFAULTS, "sample_steps": 1, "output_path": folder})
        for steps, key in ((2, "sample_warmup_s"), (DEFAULT_STEPS, "sample_clip_s")):
            prompt = SamplePrompt("a news anchor in a studio", seed=1, height=height, width=width, num_frames=frames,
                                  steps=steps, cfg_scale=DEFAULT_CFG)
            sampler = Sampler(options, run.status, [prompt], contexts)
            sampler.attach(run.accelerator, run.module)
            sampler._write = lambda target, stem, frames_: []   # render only: no video encoder needed
            graphs, start = dynamo_graphs(), time.perf_counter()
            sampler._generate_all(step=steps)
            sync()
            result[key] = time.perf_counter() - start
            result[key.replace("_s", "_graphs_compiled")] = dynamo_graphs() - graphs
    if torch.cuda.is_available():
        result["sample_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def dora_health(args, device: str) -> dict:
    """A DoRA health record of the full DiT (exact norms): median of ``args.runs`` after one untimed."""
    import torch
    from diffsynth.models.wan_video_dit import WanModel

    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT, TINY_DIT
    from diffsynth_mbc.training.components.lora_health import LoraHealth
    from diffsynth_mbc.training.lora.variants import add_dora
    from diffsynth_mbc.training.options import DEFAULTS

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with built_in(dtype, device):
        dit = WanModel(**(TI2V_5B_DIT if args.full_size else TINY_DIT))
    add_dora(dit, list(DEFAULTS["lora_target_modules"]), args.lora_rank, None, upcast_dtype=torch.float32)
    health = LoraHealth(dit.blocks, SimpleNamespace(history_listeners=[]), None, every=1, total_steps=10 ** 9,
                        warmup_steps=0, read_grads=False)
    seconds = [health.record(0, write=False)["seconds"] for _ in range(args.runs + 1)]
    return {"health_record_dora_s": statistics.median(seconds[1:]), "health_record_dora_s_runs": seconds[1:],
            "health_record_dora_first_s": seconds[0], "device": str(device),
            "dora_layers": sum(len(layers) for layers in health.layers)}


# ---------------------------------------------------------------------------------------------
# a setting


def measure_setting(args) -> dict:
    import torch

    choices, names, _ = SETTINGS[args.setting]
    names = tuple(args.rows.split(",")) if args.rows else names
    cuda = torch.cuda.is_available() and args.full_size
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if args.setting == "dora_health":
        return {"setting": args.setting, "extras": dora_health(args, "cuda" if cuda else "cpu")}
    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT, TINY_DIT

    setting = Setting(**choices)
    run, info = build_step_run(setting, random_dit_pipeline(TI2V_5B_DIT if args.full_size else TINY_DIT),
                               args.lora_rank)
    rows = {name: sized(ROWS[name], args.full_size) for name in names}
    dtype = next(p for p in run.module.parameters() if not p.requires_grad).dtype
    pools = {name: row_samples(name, row, args.full_size, dtype, seed) for seed, (name, row) in enumerate(rows.items())}
    print(f"{args.setting}: {info['device']}, {info['mixed_precision']}, {info['recompute_blocks']}/"
          f"{info['num_blocks']} blocks recompute, compile {info['compile_reason']}", file=sys.stderr, flush=True)
    with attention_backends(setting.attention):   # the SDPA kernels the setting allows (a V100's: efficient)
        measured = time_rows(run, rows, pools, args, sync)
        extras = measure_extras(run, pools[names[0]][0], args, sync) if args.extras else None
    blocks = run.accelerator.unwrap_model(run.module).blocks
    info.update(compiled=blocks.compiled, compile_status=run.status.state.get("compile_reason"))
    peak = peak_flops(info["device"], args.peak_tflops)
    text_len = text_shape(args.full_size)[0]
    result_rows = []
    for name, row in rows.items():
        from diffsynth_mbc.training.step.micro_batch import sample_tokens

        summary = summarise(measured["feeds"][name], measured["timed"][name], sample_tokens(pools[name][0]), info,
                            text_len, peak)
        result_rows.append({**summary, "row": name, "shape": f"{row.width}x{row.height}x{row.num_frames}",
                            "modes": list(row.modes), "useful_mfu": useful_mfu(summary, info, text_len, peak)})
    result = {"setting": args.setting, "choices": choices, "info": info, "peak_flops": peak, "rows": result_rows,
              "graphs_while_timed": measured["graphs_while_timed"], "runs": args.runs, "steps": args.steps,
              "warmup": args.warmup}
    if extras is not None:
        result["extras"] = extras
    return result


def measure_extras(run, clip: dict, args, sync) -> dict:
    """The health record, the validation sample and the sample clip, on the module the rows trained."""
    extras = health_record_seconds(run, lambda: [dict(clip)], args.runs)
    print(f"  health record {extras['health_record_s']:.3f} s", file=sys.stderr, flush=True)
    extras.update(validation_seconds(run, dict(clip), args.runs, sync))
    print(f"  validation sample {extras['val_sample_s']:.3f} s", file=sys.stderr, flush=True)
    full = ROWS["default"]
    size = (full.width, full.height, full.num_frames) if args.full_size else (64, 64, 5)
    extras.update(sample_clip_seconds(run, size, args.full_size, sync))
    print(f"  sample clip {extras['sample_clip_s']:.1f} s", file=sys.stderr, flush=True)
    return extras


def useful_mfu(summary: dict, info: dict, text_len: int, peak: float | None) -> float | None:
    """The FLOPs a LoRA step needs over s/step x peak: 4PT (forward, and backward to the inputs only: the frozen
    weights take no gradient) + attention forward and backward; recomputation not counted."""
    if not peak:
        return None
    tokens = summary["tokens_per_step"] // summary["samples_per_step"]
    layers, dim, parameters = info["dit_layers"], info["dit_dim"], info["dit_parameters"]
    per_sample = 4.0 * parameters * tokens + 12.0 * layers * dim * tokens ** 2 + 12.0 * layers * dim * tokens * text_len
    return summary["samples_per_step"] * per_sample / (summary["s_per_step"] * peak)


def report(result: dict) -> str:
    lines = [f"setting {result['setting']}"]
    for row in result.get("rows", []):
        memory = (f"{row['max_memory_allocated_gib']:.1f} GiB" if "max_memory_allocated_gib" in row
                  else f"{row['peak_rss_mib']:.0f} MiB RSS")
        mfu = "" if row["mfu"] is None else f", MFU {row['mfu']:.1%}, useful {row['useful_mfu']:.1%}"
        lines.append(f"  {row['row']:<14} {row['shape']:>13} x{row['samples_per_step']}: {row['s_per_step']:.4f} s/step"
                     f"{mfu}, {memory}, warm-up {row['warmup_s']:.1f} s ({row['graphs_compiled']} graphs), "
                     f"kernels {','.join(row['attention_kernels'])}")
    if "graphs_while_timed" in result:
        lines.append(f"  graphs compiled while timed: {result['graphs_while_timed']}")
    for key, value in result.get("extras", {}).items():
        if not isinstance(value, list):
            lines.append(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full-size", action="store_true", help="Wan2.2-TI2V-5B at full size (CUDA only)")
    parser.add_argument("--setting", choices=tuple(SETTINGS), default="default")
    parser.add_argument("--extras", action="store_true", help="health record, validation sample, sample clip")
    parser.add_argument("--rows", help="comma-separated rows to time instead of the setting's (e.g. one_image)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per row per run (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row first (default 2)")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s for MFU")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    if args.extras and args.setting != "default":
        parser.error("--extras runs with --setting default")
    if args.rows and not set(args.rows.split(",")) <= set(ROWS):
        parser.error(f"--rows: each of {', '.join(ROWS)}")
    if min(args.runs, args.steps) < 1 or args.warmup < 1:
        parser.error("--runs, --steps and --warmup must be at least 1")
    refusal = refuse_to_start("bench_rows.py", args.full_size, f"bench_rows.py: {NO_CUDA}",
                              SETTINGS[args.setting][2] if args.full_size else None)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    result = measure_setting(args)
    print_and_save(report(result), result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
