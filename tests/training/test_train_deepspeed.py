"""The shipped DeepSpeed ZeRO-2 config trains on 2 CPU ranks (mid-run failures: tests/test_resume.py)."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffsynth_mbc.data.demo import prepare
from e2e_helpers import REPO, demo_flags, read_health, read_history, read_status
from forked_ranks import run_training

pytestmark = pytest.mark.slow


# Accelerate's whole-model gather made to fail in each rank: saving the LoRA must never use it (under DeepSpeed it
# would gather the 5B model to the CPU on every rank at every save).
NO_GATHER = """
from accelerate import Accelerator

def refuse(*args, **kwargs):
    raise AssertionError("Accelerator.get_state_dict was called")

Accelerator.get_state_dict = refuse
"""


def test_deepspeed_zero2_config_trains_on_two_cpu_ranks(tmp_path, capsys):
    root = tmp_path / "demo"
    prepare(root, num_videos=3, num_images=2)
    # The catalogue as a one-item `datasets` list (several catalogues' path) and a frame choice, under ZeRO-2 too.
    listing = tmp_path / "datasets.yaml"
    listing.write_text(json.dumps([{"base_path": str(root / "catalog"),
                                    "metadata_path": str(root / "metadata" / "metadata.csv"), "name": "demo"}]))
    flags = demo_flags(root, num_epochs=1, max_grad_norm=0.5, save_steps=1,
                       timestep_sampling="logit_normal", timestep_strata=2, loss_weighting="none",
                       caption_dropout=0.5, frame_sampling="uniform", datasets=listing,
                       # DoRA's magnitudes and LoRA+'s second optimizer group under ZeRO-2
                       lora_variant="dora", loraplus_lr_ratio=4, ema_decay=0.9)
    for one_catalogue in ("--dataset_base_path", "--dataset_metadata_path"):
        del flags[flags.index(one_catalogue):flags.index(one_catalogue) + 2]
    extensions = tmp_path / "torch_extensions"
    result = run_training(tmp_path, flags, timeout=540, prelude=NO_GATHER, OMP_NUM_THREADS=1,
                          TORCH_EXTENSIONS_DIR=extensions,
                          config_file=str(REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # DeepSpeed's shared-memory inference all-reduce is not compiled for a CPU training run
    assert not list(extensions.glob("*shm_comm*")) and "shm_comm_op built" not in result.stdout + result.stderr
    assert "DeepSpeed" in result.stdout + result.stderr or "deepspeed" in result.stdout + result.stderr
    # 5 rows x repeat 2 = 10 samples -> 5 per rank -> accumulation 2 -> 3 steps, on both ranks.
    for rank in (0, 1):
        state = read_status(root / "logs", rank)
        assert state["status"] == "finished"
        assert state["step"] == state["total_steps"] == 3
        assert state["deepspeed_gradient_clipping"] == 0.5   # --max_grad_norm, not the config's 1.0
        assert [d["name"] for d in state["plan"]["datasets"]] == ["demo"]   # counted per catalogue
        assert [line["step"] for line in read_history(root / "logs", rank)] == [1, 2, 3]
        for line in read_history(root / "logs", rank):   # each sample's timestep and loss, for the chart
            assert len(line["timesteps"]) == len(line["timestep_losses"]) >= 1
            assert all(0 <= t <= 1000 for t in line["timesteps"])
        assert 0 < state["captions_dropped"] < state["samples_seen"]   # caption dropout works under ZeRO-2
        # LoRA health under ZeRO-2 (DoRA): the parameters are whole, the gradients the engine's own (null)
        health = read_health(root / "logs", rank)
        assert [record["step"] for record in health] == [0, 3]
        assert health[0]["update_norm_by_block"] == [0.0, 0.0] and min(health[1]["update_norm_by_block"]) > 0
        assert all(record["grad_norm_by_block"] is None for record in health)
    assert (root / "lora" / "lora.safetensors").stat().st_size > 0
    assert safe_open(str(root / "lora" / "lora.safetensors"), framework="pt").metadata()["lora_variant"] == "dora"
    assert sorted(p.name for p in (root / "lora").glob("step-*.safetensors") if "_ema" not in p.name) == [
        "step-1.safetensors", "step-2.safetensors", "step-3.safetensors"]   # every save went without the gather
    # --ema_decay under ZeRO-2: the engine's parameters are read after each step (ZeRO-2 does not shard them).
    assert sorted(p.name for p in (root / "lora").glob("*_ema.safetensors")) == [
        "epoch-001_ema.safetensors", "lora_ema.safetensors", "step-1_ema.safetensors", "step-2_ema.safetensors",
        "step-3_ema.safetensors"]
    raw, average = (load_file(str(root / "lora" / name)) for name in ("lora.safetensors", "lora_ema.safetensors"))
    assert raw.keys() == average.keys() and any(not torch.equal(raw[key], average[key]) for key in raw)
    first = load_file(str(root / "lora" / "step-1.safetensors"))
    for key in (k for k in raw if k.endswith("lora_B.weight")):   # B starts at zero: update 0 keeps 0.9 of step 1
        torch.testing.assert_close(load_file(str(root / "lora" / "step-1_ema.safetensors"))[key], 0.9 * first[key],
                                   rtol=0, atol=1e-7)
    assert (root / "lora" / "checkpoints" / "step-00000003" / "ema_state.safetensors").is_file()
    # ZeRO-2 shards AdamW's state over the 2 ranks: a resume on another number of GPUs is refused before the
    # launch, saying what to do; on 2 it is accepted, and this run has ended: the launcher says there is nothing to
    # train and starts nothing (the launcher's own check, python -m diffsynth_mbc.plan)
    from diffsynth_mbc.training.plan import command

    capsys.readouterr()
    assert command.main(["--check_paths", "--gpus", "1", *flags, "--resume", "latest"]) == 2
    refusal = capsys.readouterr().err
    assert "step-00000003 was saved by 2 DeepSpeed ZeRO-2 processes, whose optimizer state is sharded 2 ways; " \
           "this run has 1. Resume it on 2 processes (--gpus)" in refusal and "--init_lora" in refusal
    assert command.main(["--check_paths", "--gpus", "2", *flags, "--resume", "latest"]) == command.RUN_HAS_ENDED
    assert "this run finished at step 3 (1 of 1 epochs): nothing more to train" in capsys.readouterr().err
