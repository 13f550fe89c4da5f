"""The step/ETA callback has DiffSynth's ModelLogger shape: DiffSynth's own training loop can drive it."""

import json
import math
import subprocess
from pathlib import Path

import pytest

from e2e_helpers import REPO

pytestmark = pytest.mark.slow


def test_progress_logger_inside_diffsynths_launch_training_task(tmp_path, monkeypatch):
    from diffsynth.trainers.utils import launch_training_task

    from diffsynth_mbc.data.dataset import MBCVideoDataset
    from diffsynth_mbc.data.demo import prepare
    from diffsynth_mbc.models.pipeline import build_demo_pipeline
    from diffsynth_mbc.training.reporting.progress import ProgressLogger
    from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter
    from diffsynth_mbc.training.lora.module import WanTI2VLoraModule

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "demo"
    prepare(root, num_videos=3, num_images=2)
    dataset = MBCVideoDataset(str(root / "catalog"), str(root / "metadata" / "metadata.csv"), num_frames=9,
                              height=64, width=64)
    dataset.load_from_cache = False   # DiffSynth 1.1.8's loop reads this attribute
    module = WanTI2VLoraModule(build_demo_pipeline(seed=0), lora_rank=4, use_gradient_checkpointing=False)
    accumulation = 2
    steps_per_epoch = math.ceil(dataset.rows / accumulation)
    status = RankStatusWriter(tmp_path / "logs", "diffsynth-loop", 0, 0, 1)
    logger = ProgressLogger(str(tmp_path / "out"), status, steps_per_epoch=steps_per_epoch, num_epochs=1,
                            samples_per_step=accumulation)
    launch_training_task(dataset, module, logger, learning_rate=1e-3, num_workers=0, num_epochs=1,
                         gradient_accumulation_steps=accumulation)
    status.close()

    lines = [json.loads(line) for line in (tmp_path / "logs" / "training_gpu0.jsonl").read_text().splitlines()]
    history = [line for line in lines if "kind" not in line]
    assert [line["step"] for line in history] == list(range(1, steps_per_epoch + 1))   # optimizer steps, not micro-batches
    # ModelLogger's own LoRA files (the epoch's, the end's) are timed apart from the steps.
    assert [(line["overhead"], line["step"]) for line in lines if line.get("kind") == "overhead"] == [
        ("lora", steps_per_epoch)] * 2
    assert all(line["loss"] is None for line in history)    # DiffSynth's loop does not pass the loss on
    state = json.loads((tmp_path / "logs" / "training_gpu0.json").read_text())
    assert state["status"] == "finished" and state["step"] == state["total_steps"] == steps_per_epoch
    assert (tmp_path / "out" / "epoch-0.safetensors").stat().st_size > 0   # saved by ModelLogger itself


@pytest.mark.parametrize("config", sorted((REPO / "configs" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_accelerate_configs_load_with_accelerate(config):
    from accelerate.commands.config.config_args import ClusterConfig

    cluster = ClusterConfig.from_yaml_file(str(config))
    assert cluster.mixed_precision == "no"   # the training chooses (--mixed_precision auto)
    if "deepspeed" in config.name:
        assert cluster.deepspeed_config["zero_stage"] == 2
        assert "gradient_accumulation_steps" not in cluster.deepspeed_config   # taken from the training flag


def test_nccl_settings_for_pcie_boxes_are_defaults_the_environment_overrides():
    script = f'NCCL_P2P_DISABLE=1; source {REPO / "configs" / "nccl_pcie.env"}; ' \
             'echo "$NCCL_TIMEOUT $NCCL_BLOCKING_WAIT $NCCL_ASYNC_ERROR_HANDLING $NCCL_IB_DISABLE $NCCL_P2P_DISABLE"'
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.stdout.split() == ["1800", "1", "1", "1", "1"]
    result = subprocess.run(["bash", "-c", f"source {REPO / 'configs' / 'nccl_pcie.env'}; echo $NCCL_P2P_DISABLE"],
                            capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "0"
    assert Path(REPO / "configs" / "nccl_pcie.env").read_text().count("export") == 1
