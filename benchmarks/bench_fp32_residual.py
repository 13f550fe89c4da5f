"""The fp32 residual stream (``--fp32_residual``) against DiffSynth's forward, in fp16 and bf16: how close each is to
an fp32 forward, what it keeps for backward, and its time.

    python benchmarks/bench_fp32_residual.py [--runs 5] [--models tiny,tiny_massive,mid,mid_massive] [--json FILE]

Models (random weights, DiffSynth's ``WanModel`` with every TI2V-5B flag, LoRA rank 4 on the presets' targets with
B drawn so it has an effect): ``tiny`` is the demo's DiT (dim 64, 2 blocks); ``mid`` a deeper, wider one (dim 384,
ffn 1536, 4 heads, 12 blocks); ``_massive`` the same with two residual channels driven to 80,000, past fp16's
65,504, as a DiT's massive activations are (``models.pipeline.plant_massive_activations``). The DiT's input is
one i2v clip (latents 48 x 3 x 16 x 16: 192 tokens; the demo's 8 x 8: 48 tokens) noised at timesteps 256, 512 and
896, its latents and text embedding rounded to the dtype under test: the fp32 model sees the same rounded inputs and
timesteps (exact in fp16 and bf16), so the distance is the DiT's own computation.

For each of fp16 and bf16, DiffSynth's forward (``off``) and the fp32 residual stream (``on``), on the model cast to
that dtype, every block keeping its activations: the prediction's and the LoRA gradients' distance from the fp32
model's (relative L2, over the three timesteps; the loss scaled by 2^16 before backward, as the fp16 loss scaler
starts, and the gradients unscaled), whether everything was finite, the largest residual magnitude a block wrote,
the bytes autograd keeps for backward (each saved tensor once) per token and block, and the median seconds of a
forward and backward over --runs runs (the four settings in turns in each run, so a busy machine slows them alike).
On a CPU the times say little about a GPU's (fp16 and bf16 matmuls run without tensor cores); the parity and the
bytes kept are the same computation on any device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from diffsynth_mbc.models.pipeline import TINY_DIT, build_demo_pipeline, plant_massive_activations  # noqa: E402
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule  # noqa: E402
from diffsynth_mbc.training.step.batch_loss import dit_forward, sample_mse  # noqa: E402

MODELS = {"tiny": (TINY_DIT, 8), "mid": (dict(TINY_DIT, dim=384, ffn_dim=1536, num_heads=4, num_layers=12), 16)}
TIMESTEPS = (256, 512, 896)   # exact in fp16 and bf16: both models embed the same value
LOSS_SCALE = 2.0 ** 16
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def build(name: str, dtype, fp32_residual: bool, seed: int = 42) -> WanTI2VLoraModule:
    from diffsynth.models.wan_video_dit import WanModel

    config, _ = MODELS[name.replace("_massive", "")]
    pipe = build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=seed, load_encoders=False)
    torch.manual_seed(seed)
    pipe.dit = WanModel(**config)
    if name.endswith("_massive"):
        plant_massive_activations(pipe.dit)
    pipe = pipe.to(dtype=dtype)
    pipe.torch_dtype = dtype
    torch.manual_seed(0)
    module = WanTI2VLoraModule(pipe, lora_rank=4, recompute_blocks=0, fp32_residual=fp32_residual)
    for parameter_name, parameter in module.named_parameters():
        if "lora_B" in parameter_name:
            torch.nn.init.normal_(parameter, std=0.02)
    return module


def samples(name: str, dtype, seed: int = 1) -> list[dict]:
    """One i2v clip noised at each of ``TIMESTEPS`` (in fp32, frame 0 the clean condition), its latents, context and
    timestep rounded to ``dtype`` and held in fp32: the fp32 model and the ``dtype`` one see exactly the same inputs."""
    config, side = MODELS[name.replace("_massive", "")]
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randn((1, 48, 3, side, side), generator=generator)
    noise = torch.randn(clean.shape, generator=generator)
    noise[:, :, :1] = clean[:, :, :1]
    context = torch.randn((1, 32, config["text_dim"]), generator=generator)
    rounded = lambda tensor: tensor.to(dtype).float()  # noqa: E731
    out = []
    for timestep in TIMESTEPS:
        sigma = timestep / 1000
        out.append({"latents": rounded((1 - sigma) * clean + sigma * noise), "target": noise - clean,
                    "context": rounded(context), "timestep": torch.tensor([float(timestep)])})
    return out


class SavedBytes:
    """The bytes autograd keeps for backward while it is on: each saved tensor's storage counted once, the module's
    own parameters left out (they are there anyway)."""

    def __init__(self, module):
        self.parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: dict = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def step(module, inputs: dict, saved: SavedBytes | None = None):
    """(prediction, unscaled LoRA gradients, largest residual magnitude) of one forward and backward of the DiT on
    ``inputs`` (``samples``), the loss the i2v MSE over frames 1.. ."""
    dtype = module.pipe.torch_dtype
    largest = []
    hooks = [block.register_forward_hook(lambda _m, _i, out: largest.append(float(out.detach().abs().max())))
             for block in module.pipe.dit.blocks]
    module.zero_grad(set_to_none=True)
    try:
        with saved or contextlib.nullcontext():
            prediction = dit_forward(module.pipe.dit, inputs["latents"].to(dtype), inputs["timestep"].to(dtype),
                                     inputs["context"].to(dtype), module.blocks, [True])
            loss = sample_mse(prediction, inputs["target"], skip_first_frame=True)
        (loss * LOSS_SCALE).backward()
    finally:
        for hook in hooks:
            hook.remove()
    gradients = torch.cat([p.grad.float().flatten() / LOSS_SCALE for p in module.parameters() if p.requires_grad])
    return prediction.detach().float(), gradients, max(largest)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def measure(name: str, runs: int) -> dict:
    reference = build(name, torch.float32, False)
    tokens = 3 * (MODELS[name.replace("_massive", "")][1] // 2) ** 2
    layers = len(reference.pipe.dit.blocks)
    rows = {}
    for precision, dtype in DTYPES.items():
        inputs = samples(name, dtype)
        expected = [step(reference, sample)[:2] for sample in inputs]
        for on in (False, True):
            module = build(name, dtype, on)
            got = [step(module, sample) for sample in inputs]
            predictions = torch.cat([g[0].flatten() for g in got])
            gradients = torch.cat([g[1] for g in got])
            finite = bool(torch.isfinite(predictions).all() and torch.isfinite(gradients).all())
            saved = SavedBytes(module)
            step(module, inputs[1], saved)
            rows[(precision, on)] = {
                "model": name, "precision": precision, "fp32_residual": on, "finite": finite,
                "prediction_error": relative(predictions, torch.cat([e[0].flatten() for e in expected])) if finite
                else None,
                "gradient_error": relative(gradients, torch.cat([e[1] for e in expected])) if finite else None,
                "largest_residual": max(g[2] for g in got),
                "saved_bytes": saved.total, "saved_bytes_per_token_block": saved.total / tokens / layers,
                "module": module, "inputs": inputs[1], "runs": []}
    for _ in range(runs):   # the settings in turns, run by run
        for row in rows.values():
            start = time.perf_counter()
            step(row["module"], row["inputs"])
            row["runs"].append(time.perf_counter() - start)
    out = []
    for row in rows.values():
        row.pop("module")
        row.pop("inputs")
        row["seconds"] = statistics.median(row["runs"])
        out.append(row)
    return {"model": name, "tokens": tokens, "layers": layers, "rows": out}


def print_table(results: list[dict]) -> None:
    print(f"{'model':<13} {'precision':<9} {'residual':<10} {'prediction':>10} {'gradients':>10} {'largest':>10} "
          f"{'kept B/token/block':>18} {'s (median)':>10} {'ratio':>6}")
    for result in results:
        rows = {(row["precision"], row["fp32_residual"]): row for row in result["rows"]}
        for (precision, on), row in rows.items():
            error = lambda value: "non-finite" if value is None else f"{value:.2%}"  # noqa: E731
            ratio = row["seconds"] / rows[(precision, False)]["seconds"]
            print(f"{result['model']:<13} {precision:<9} {'fp32' if on else 'model':<10} "
                  f"{error(row['prediction_error']):>10} {error(row['gradient_error']):>10} "
                  f"{row['largest_residual']:>10,.0f} {row['saved_bytes_per_token_block']:>18,.0f} "
                  f"{row['seconds']:>10.4f} {ratio:>5.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--models", default="tiny,tiny_massive,mid,mid_massive")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in names if name.replace("_massive", "") not in MODELS]
    if unknown or args.runs < 1:
        parser.error(f"--models takes {', '.join(m + '[_massive]' for m in MODELS)}; --runs at least 1")
    torch.set_grad_enabled(True)
    results = [measure(name, args.runs) for name in names]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads; {args.runs} runs; relative L2 distance "
          "from the fp32 model (prediction, LoRA gradients), the largest residual magnitude, what backward keeps")
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "runs": args.runs, "results": results},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
