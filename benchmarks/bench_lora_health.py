"""LoRA health's cost (``--health_steps``): what one ``{"kind": "lora_health"}`` record computes, against a step.

    python benchmarks/bench_lora_health.py [--runs 5] [--dense-blocks 3] [--skip-tiny] [--skip-full-size]

1. The tiny demo-width DiT (``TINY_DIT``, random weights, 64x64x9 clips from a cache-like sample) and the
   training's own step (``step_timing``: the Accelerator, the LoRA module, AdamW, ``forward_backward``): the
   median s/step of --runs runs without health records, then with a record on every step (the blocks' gradient
   norms read inside the step, the update norms after it), each record's cost and the ratio, in one run.
2. Full-size TI2V-5B shapes: 30 blocks of dim 3072 and ffn 14336, the presets' targets (q, k, v, o of self- and
   cross-attention, ffn.0, ffn.2: 300 LoRA layers) at rank 32 with random weights, on this machine (no base
   weights: a plain LoRA's norms never read them): the update norms as the training takes them (the r x r
   products of all layers of one shape batched), the same one layer at a time, and the dense way (``B @ A`` for
   each layer, then its norm; timed on --dense-blocks blocks and scaled to 30), each the median of --runs, with
   the ratios; the 30 blocks' gradient norms; and DoRA's exact norms for one block (its bf16 base weights read
   in row chunks) scaled to 30. Pass --device cuda on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from step_timing import seconds_of_runs  # noqa: E402

from diffsynth_mbc.training.components.lora_health import (LayerNorms, LoraHealth, grad_norms,  # noqa: E402
                                                          lora_update_norm, update_norms)

DIM, FFN, BLOCKS = 3072, 14336, 30
# (out, in) of the LoRA-wrapped Linear layers of one TI2V-5B block under q,k,v,o,ffn.0,ffn.2
BLOCK_SHAPES = [(DIM, DIM)] * 8 + [(FFN, DIM), (DIM, FFN)]


def median_seconds(work, runs: int, sync) -> float:
    return statistics.median(seconds_of_runs(work, runs, sync))


# ---------------------------------------------------------------------------------------------
# the tiny model's step


class Status:
    """What ``LoraHealth`` writes to: the status writer's listeners, history and fields (kept in memory)."""

    def __init__(self):
        self.history_listeners, self.history, self.state = [], [], {}

    def append_history(self, record: dict) -> None:
        self.history.append(record)

    def update(self, **fields) -> None:
        self.state.update(fields)


def bench_tiny(args) -> None:
    from step_timing import Geometry, Setting, build_step_run, cache_like_entries, optimizer_step, random_dit_pipeline

    from diffsynth_mbc.models.pipeline import TINY_DIT, TINY_TEXT_LEN

    run, info = build_step_run(Setting(gradient_checkpointing="none"), random_dit_pipeline(TINY_DIT), args.lora_rank)
    pipe = run.accelerator.unwrap_model(run.module).pipe
    samples = cache_like_entries(Geometry(64, 64, 9, TINY_TEXT_LEN, TINY_DIT["text_dim"]), "video", 4,
                                 pipe.torch_dtype)
    cuda = run.accelerator.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    health = LoraHealth(pipe.dit.blocks, Status(), SimpleNamespace(event=lambda text: None), every=1,
                        total_steps=10**9, warmup_steps=0)
    turn = iter(range(10**9))

    def steps(with_health: bool):
        run.health = health if with_health else None
        for _ in range(args.steps):
            optimizer_step(run, [samples[next(turn) % len(samples)]])
            if with_health:
                health.record(run.position.step)

    for _ in range(args.warmup):
        steps(True)
    plain, recorded = [], []
    for _ in range(args.runs):   # in turns, so a busy machine slows both alike
        plain.append(median_seconds(lambda: steps(False), 1, sync) / args.steps)
        recorded.append(median_seconds(lambda: steps(True), 1, sync) / args.steps)
    costs = [record["seconds"] for record in health.status.history[-args.runs * args.steps:]]
    step, with_record, cost = statistics.median(plain), statistics.median(recorded), statistics.median(costs)
    print(f"tiny demo-width DiT ({info['dit_layers']} blocks, dim {info['dit_dim']}, LoRA rank {args.lora_rank}, "
          f"{info['lora_parameters']:,} LoRA parameters) on {info['device']}, median of {args.runs} runs x "
          f"{args.steps} steps")
    print(f"  step without records {step * 1e3:9.3f} ms | with a record every step {with_record * 1e3:9.3f} ms")
    print(f"  one record (update + gradient norms, as the record's 'seconds') {cost * 1e3:7.3f} ms = "
          f"{cost / step:.1%} of a step; every 10 steps (the default): {cost / step / 10:.2%}")


# ---------------------------------------------------------------------------------------------
# full-size shapes


def lora_layer(out_features: int, in_features: int, rank: int, device, generator) -> LayerNorms:
    """A ``LayerNorms`` over random A and B of these shapes (no base weight: |W|_F given as a plain number)."""
    layer = LayerNorms.__new__(LayerNorms)
    down = torch.randn(rank, in_features, generator=generator).div_(in_features ** 0.5).to(device)
    up = torch.randn(out_features, rank, generator=generator).mul_(1e-3).to(device)
    layer.module = SimpleNamespace(lora_A={"default": SimpleNamespace(weight=down)},
                                   lora_B={"default": SimpleNamespace(weight=up)}, scaling={"default": 1.0})
    layer.adapter, layer.magnitude, layer.row_norms, layer.base_norm = "default", None, None, 55.0
    return layer


def dora_layer(out_features: int, in_features: int, rank: int, device, generator) -> LayerNorms:
    """A DoRA ``LayerNorms`` over a random bf16 base weight, fp32 A, B and magnitudes (set as ``add_dora`` does)."""
    weight = torch.randn(out_features, in_features, generator=generator).div_(in_features ** 0.5).to(
        device=device, dtype=torch.bfloat16)
    down = torch.randn(rank, in_features, generator=generator).div_(in_features ** 0.5).to(device)
    up = torch.randn(out_features, rank, generator=generator).mul_(1e-3).to(device)
    magnitude = torch.linalg.norm(weight.float(), dim=1)
    module = SimpleNamespace(get_base_layer=lambda: SimpleNamespace(weight=weight),
                             lora_A={"default": SimpleNamespace(weight=down)},
                             lora_B={"default": SimpleNamespace(weight=up)}, scaling={"default": 1.0},
                             lora_magnitude_vector={"default": SimpleNamespace(weight=magnitude)})
    return LayerNorms(module, "default")


def dense_norms(blocks: list[list[LayerNorms]]) -> list[float]:
    """The same sums, the dense way: ``s B @ A`` (out x in) per layer, then its norm."""
    sums = []
    for layers in blocks:
        total = 0.0
        for layer in layers:
            down, up = layer.weights()
            total += float(torch.linalg.norm(layer.scale() * (up @ down))) / layer.base_norm
        sums.append(total)
    return sums


def exactness(layer: LayerNorms) -> tuple[float, float]:
    """Relative differences on one layer: r x r vs dense fp64, and dense fp32 vs dense fp64."""
    down, up = layer.weights()
    exact = float(torch.linalg.norm(up.double() @ down.double()))
    return (abs(float(lora_update_norm(down, up, 1.0)) - exact) / exact,
            abs(float(torch.linalg.norm(up @ down)) - exact) / exact)


def bench_full_size(args) -> None:
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    blocks = [[lora_layer(out, inp, args.lora_rank, device, generator) for out, inp in BLOCK_SHAPES]
              for _ in range(BLOCKS)]
    parameters = sum(layer.weights()[0].numel() + layer.weights()[1].numel() for layers in blocks for layer in layers)
    print(f"full-size TI2V-5B shapes: {BLOCKS} blocks x {len(BLOCK_SHAPES)} LoRA layers, rank {args.lora_rank}, "
          f"{parameters:,} LoRA parameters, on {args.device} ({torch.get_num_threads()} threads), median of "
          f"{args.runs} runs")
    batched = median_seconds(lambda: update_norms(blocks), args.runs, sync)
    one_by_one = median_seconds(lambda: [float(sum(lora_update_norm(*layer.weights(), 1.0) / layer.base_norm
                                                   for layer in layers)) for layers in blocks], args.runs, sync)
    dense_part = blocks[:args.dense_blocks]
    dense = median_seconds(lambda: dense_norms(dense_part), args.runs, sync) * BLOCKS / len(dense_part)
    agree, agree_fp32 = exactness(blocks[0][-2])
    print(f"  update norms, r x r products batched by shape (the training's) {batched * 1e3:10.1f} ms")
    print(f"  update norms, r x r products one layer at a time              {one_by_one * 1e3:10.1f} ms "
          f"({one_by_one / batched:.1f}x the batched)")
    print(f"  update norms, dense B @ A per layer (timed on {len(dense_part)} blocks, x{BLOCKS / len(dense_part):g})"
          f" {dense * 1e3:10.1f} ms ({dense / batched:.0f}x the batched)")
    print(f"  on the largest layer ({BLOCK_SHAPES[-2][0]} x {BLOCK_SHAPES[-2][1]}) the r x r norm differs from the "
          f"dense one in fp64 by {agree:.1e} (relative), the dense one in fp32 from it by {agree_fp32:.1e}")
    weights = [[torch.nn.Parameter(tensor) for layer in layers for tensor in layer.weights()] for layers in blocks]
    for group in weights:
        for parameter in group:
            parameter.grad = torch.randn_like(parameter)
    grads = median_seconds(lambda: grad_norms(weights, 1.0, 1.0), args.runs, sync)
    print(f"  gradient norms of the {BLOCKS} blocks                              {grads * 1e3:10.1f} ms")
    del weights
    dora = [[dora_layer(out, inp, args.lora_rank, device, generator) for out, inp in BLOCK_SHAPES]]
    one_block = median_seconds(lambda: update_norms(dora), args.runs, sync)
    print(f"  DoRA update norms (bf16 base weights in fp64 row chunks), one block {one_block * 1e3:8.1f} ms, "
          f"x{BLOCKS}: {one_block * BLOCKS * 1e3:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="tiny model: steps per timed run (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="tiny model: untimed runs first (default 1)")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--dense-blocks", type=int, default=3, help="blocks the dense way is timed on (default 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="full-size shapes: where (default cuda when there is one, else cpu)")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--skip-full-size", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_tiny:
        bench_tiny(args)
    if not args.skip_full_size:
        bench_full_size(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
