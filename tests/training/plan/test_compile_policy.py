"""--compile auto|on|off and --gradient_checkpointing all|none|auto|N (pure decisions)."""

import pytest

from diffsynth_mbc.training.plan.compile_policy import decide_compile
from diffsynth_mbc.training.plan.recompute import recompute_blocks


def test_auto_compiles_on_gpus_torch_can_compile_for_and_never_on_the_cpu():
    assert decide_compile("auto", cuda=True, capability=(9, 0), triton_ok=True).compile
    assert decide_compile("auto", cuda=True, capability=(7, 0), triton_ok=True).compile      # a V100
    off = decide_compile("auto", cuda=True, capability=(6, 1), triton_ok=False)
    assert not off.compile and "sm_61" in off.reason and "uncompiled" in off.reason
    assert not decide_compile("auto", cuda=False, capability=None, triton_ok=False).compile


def test_on_and_off_are_obeyed_where_they_can_be():
    assert decide_compile("on", cuda=False, capability=None, triton_ok=False).compile   # CPU: C++ backend
    assert not decide_compile("on", cuda=True, capability=(6, 0), triton_ok=False).compile
    assert not decide_compile("off", cuda=True, capability=(9, 0), triton_ok=True).compile
    with pytest.raises(ValueError):
        decide_compile("maybe", cuda=False, capability=None, triton_ok=False)


def test_gradient_checkpointing_choices_resolve_to_a_number_of_blocks():
    assert recompute_blocks("all", 30)[0] == 30 and recompute_blocks("none", 30)[0] == 0
    assert recompute_blocks("12", 30)[0] == 12
    assert recompute_blocks("auto", 30, auto_blocks=None)[0] == 30          # no GPU to size it for
    blocks, why = recompute_blocks("auto", 30, auto_blocks=17)
    assert blocks == 17 and "17 of 30" in why
    with pytest.raises(ValueError, match="the DiT has 30 blocks"):
        recompute_blocks("31", 30)
