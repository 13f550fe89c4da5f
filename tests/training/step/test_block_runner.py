"""The fast step on the tiny model from DiffSynth's classes: DiffSynth's objective bit for bit at batch 1, a
batch's loss is the mean of its samples' losses, the LoRA computes in the base dtype with fp32 master weights,
partial checkpointing and compiled blocks give the same gradients and losses."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffsynth_mbc.training.step.batch_loss import batch_loss, draw_timestep_ids
from diffsynth_mbc.training.step.block_runner import BlockRunner
from diffsynth_mbc.training.components.guards import NonFiniteGuard
from tiny_step import make_module, scaled_step


def test_with_objective_diffsynth_a_batch_of_one_is_diffsynths_training_loss_bit_for_bit(entries):
    videos, images = entries
    module = make_module(objective="diffsynth")
    for sample in (videos[0], images[0]):
        torch.manual_seed(7)
        ours = module(dict(sample))
        torch.manual_seed(7)
        inputs = module.inputs_from_cache(dict(sample))
        models = {name: getattr(module.pipe, name) for name in module.pipe.in_iteration_models}
        theirs = module.pipe.training_loss(**models, **inputs)
        assert torch.equal(ours, theirs.reshape(ours.shape)), (float(ours), float(theirs))


@pytest.mark.parametrize("group", ["videos", "images"])
def test_a_batch_loss_is_the_mean_of_its_samples_losses_one_by_one(entries, group):
    samples = entries[0] if group == "videos" else entries[1]
    module = make_module()
    torch.manual_seed(3)
    inputs = [module.inputs_from_cache(dict(s)) for s in samples]
    ids = draw_timestep_ids(module.pipe, inputs)
    assert len(set(ids)) > 1            # each sample has its own timestep
    together, each = batch_loss(module.pipe, inputs, module.blocks, ids)
    one_by_one = [batch_loss(module.pipe, [item], module.blocks, [i])[0] for item, i in zip(inputs, ids)]
    torch.testing.assert_close(torch.stack(each), torch.stack(one_by_one), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(together, torch.stack(one_by_one).mean(), rtol=1e-5, atol=1e-6)


def lora_grads(module) -> dict:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("recompute, offload", [(0, False), (1, False), (2, True)])
def test_recomputing_some_blocks_gives_the_gradients_of_recomputing_all(entries, recompute, offload):
    videos, _ = entries
    results = []
    for blocks in (None, recompute):
        module = make_module(recompute_blocks=blocks, use_gradient_checkpointing_offload=offload and blocks is not None)
        assert module.blocks.recompute == (len(module.pipe.dit.blocks) if blocks is None else blocks)
        torch.manual_seed(5)
        module([dict(s) for s in videos]).backward()
        results.append(lora_grads(module))
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-5, atol=1e-7, msg=name)


class Fp32Allocations(TorchDispatchMode):
    """Records the sizes of fp32 tensors that ops produce."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.sizes.append(tensor.numel())
        return out


def test_the_lora_computes_in_bf16_without_upcasting_the_activations():
    module = make_module(dtype=torch.bfloat16)
    layer = module.pipe.dit.blocks[0].self_attn.q
    assert layer.lora_A["default"].weight.dtype == torch.float32      # fp32 master weights
    x = torch.randn(2, 64, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    with Fp32Allocations() as recorded:
        out = layer(x)
        out.sum().backward()
    assert out.dtype == torch.bfloat16
    activation = x.numel()
    assert not [n for n in recorded.sizes if n >= activation], recorded.sizes
    assert layer.lora_A["default"].weight.grad.dtype == torch.float32


def test_upcast_lora_compute_keeps_pefts_own_forward_for_comparison():
    module = make_module(dtype=torch.bfloat16, lora_compute="upcast")
    layer = module.pipe.dit.blocks[0].self_attn.q
    x = torch.randn(2, 64, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    with Fp32Allocations() as recorded:
        layer(x).sum().backward()
    assert [n for n in recorded.sizes if n >= x.numel()]   # peft casts the activations up to fp32
    with pytest.raises(ValueError, match="lora_compute"):
        make_module(lora_compute="fp8")


def test_fp32_master_weights_keep_updates_that_bf16_weights_would_lose(entries):
    videos, _ = entries
    module = make_module(dtype=torch.bfloat16)
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}
    before = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, weight_decay=0.0)
    torch.manual_seed(1)
    module([dict(videos[0])]).backward()
    optimizer.step()
    changed = torch.cat([(p != b).flatten() for p, b in zip(trainable, before)]).float().mean()
    # The same update applied to bf16 copies of the weights (what bf16 parameters would hold):
    as_bf16 = torch.cat([((b.to(torch.bfloat16) + (p - b).to(torch.bfloat16)) != b.to(torch.bfloat16)).flatten()
                         for p, b in zip(trainable, before)]).float().mean()
    assert changed > 0.99          # the fp32 master weights took the 1e-6 step nearly everywhere
    assert as_bf16 < 0.05          # bf16 weights would have rounded it away nearly everywhere


def test_bf16_losses_match_an_all_fp32_reference_within_bf16_tolerance(entries):
    videos, images = entries
    reference, low = make_module(), make_module(dtype=torch.bfloat16)
    for sample in (*videos, *images):
        torch.manual_seed(11)
        expected = float(reference([dict(sample)]).detach())
        torch.manual_seed(11)
        got = float(low([dict(sample)]).detach())
        assert got == pytest.approx(expected, rel=0.05, abs=0.01)


def test_fp16_with_the_loss_scaler_skips_and_counts_a_non_finite_step(entries):
    """fp16 base, fp32 LoRA: torch's GradScaler unscales the fp32 gradients, skips the overflowed step and lowers
    the scale; the guard counts it; the next step trains."""
    videos, _ = entries
    module = make_module(dtype=torch.float16)
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    guard = NonFiniteGuard(max_in_a_row=20, precision="fp16")
    for step, factor in ((1, float("inf")), (2, 1.0)):
        before = [p.detach().clone() for p in trainable]
        scale = scaler.get_scale()
        torch.manual_seed(step)
        loss = module([dict(videos[0])]) * factor
        skipped = scaled_step(loss, scaler, optimizer, trainable, guard, step)
        unchanged = all(torch.equal(p, b) for p, b in zip(trainable, before))
        if step == 1:
            assert skipped and unchanged and scaler.get_scale() == scale / 2
        else:
            assert not skipped and not unchanged
    assert guard.total == 1


@pytest.mark.slow
@pytest.mark.parametrize("fp32_residual", [False, True])
def test_compiled_blocks_train_to_the_losses_of_uncompiled_ones_from_one_graph(entries, tmp_path, monkeypatch,
                                                                               fp32_residual):
    """The blocks are identical, so one compiled graph serves them all (block 0's input, from the frozen patch
    embedding, did not require grad and got a graph of its own: the compile's time twice). DiffSynth's forward and the
    fp32 residual stream's (``step/fp32_residual.py``: the stream enters block 0 in fp32 already) alike."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    videos, _ = entries
    losses = {}
    torch._dynamo.reset()   # graphs an earlier test compiled in this process would not be counted
    counters.clear()
    # Scalar C++ kernels: the same code on any CI machine's CPU, whatever vector units it has, and about half the
    # C++ compiler's time (no probe of each vector ISA, 10 test builds each loaded in a new Python; 20 kernels
    # instead of 30). The GPUs compile Triton kernels, not these. (Inductor's own patch: monkeypatch's undo leaves its
    # config without the key, and the next test in the process fails.)
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        for compiled in (False, True):
            module = make_module(compile_blocks=compiled, fp32_residual=fp32_residual)
            assert module.blocks.compiled is compiled
            trainable = [p for p in module.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-3)
            torch.manual_seed(9)
            values = []
            for step in range(3):
                loss = module([dict(s) for s in videos])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                values.append(float(loss))
            losses[compiled] = values
    assert losses[True] == pytest.approx(losses[False], rel=1e-4, abs=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_failed_compile_falls_back_to_the_plain_blocks(capsys):
    module = make_module(compile_blocks=True)
    module.blocks.give_up_compiling(RuntimeError("no C++ compiler\nmore"))
    assert not module.blocks.compiled
    assert all(block._compiled_call_impl is None for block in module.blocks.blocks)
    assert "no C++ compiler" in capsys.readouterr().err and "more" not in capsys.readouterr().err


def test_the_runner_keeps_the_largest_residual_magnitude_the_blocks_wrote_until_it_is_taken(entries):
    videos, _ = entries
    module = make_module(recompute_blocks=1)
    written = []
    for block in module.pipe.dit.blocks:
        block.register_forward_hook(lambda _m, _i, out: written.append(float(out.detach().abs().max())))
    module([dict(videos[0])]).backward()   # block 0 recomputes in backward: its second run is not a new output
    assert module.blocks.take_largest_residual() == pytest.approx(max(written[:2]))
    assert module.blocks.take_largest_residual() is None   # taken: the next step starts afresh


def test_the_block_runner_describes_its_plan():
    blocks = [torch.nn.Identity() for _ in range(30)]
    assert BlockRunner(blocks, 30).describe().startswith("gradient checkpointing: every block")
    assert "the first 12 of 30 blocks" in BlockRunner(blocks, 12).describe()
    assert "no block" in BlockRunner(blocks, 0).describe()
    assert BlockRunner(blocks, 99).recompute == 30


def test_the_terminal_says_the_first_steps_compile_and_how_long_they_took():
    import io

    from diffsynth_mbc.training.step.block_runner import CompileTimer

    stream = io.StringIO()
    timer = CompileTimer(enabled=True, stream=stream, steps=2)
    for _ in range(3):
        timer.step_started()
        timer.step_finished()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "compiling the DiT blocks: the first steps take longer ..."
    assert lines[1].startswith("compiled: the first 2 steps took ") and len(lines) == 2
    quiet = io.StringIO()
    CompileTimer(enabled=False, stream=quiet).step_started()
    assert quiet.getvalue() == ""
