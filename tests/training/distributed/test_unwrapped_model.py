"""``unwrapped_model``: the module inside DDP, as accelerate's ``unwrap_model`` gives it, without importing DeepSpeed
(accelerate's does, to test for its engine, whenever DeepSpeed is installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # a Python process of its own: whether DeepSpeed was imported is per process

CHECK = """
import sys
import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from diffsynth_mbc.training.distributed.accelerator import unwrapped_model

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    accelerator = Accelerator(cpu=True)
    inner = torch.nn.Linear(4, 4)
    wrapped = DistributedDataParallel(inner)
    assert unwrapped_model(accelerator, wrapped) is inner
    assert unwrapped_model(accelerator, inner) is inner
    assert "deepspeed" not in sys.modules, "unwrapped_model imported DeepSpeed"
    assert accelerator.unwrap_model(wrapped) is inner   # the same answer as accelerate's ...
    print("accelerate's unwrap_model imported DeepSpeed:", "deepspeed" in sys.modules)   # ... which imports it
finally:
    dist.destroy_process_group()
"""


def test_the_module_inside_ddp_comes_out_without_deepspeed_being_imported():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "accelerate's unwrap_model imported DeepSpeed: True" in result.stdout, result.stdout
