"""EMA of the LoRA weights (--ema_decay): options, decay, the fp32 shadow, swapping it in and out, its checkpoint
state; and an in-process run on the tiny model that leaves the raw training bit for bit as it was."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints.fingerprint import fingerprint_differences, run_fingerprint
from diffsynth_mbc.run_layout import EMA_STATE, ema_twin_name
from diffsynth_mbc.training.lora.ema import LoraEma, decay_at, weights_for
from diffsynth_mbc.training.options import resolve_options
from e2e_helpers import REPO

REQUIRED = ["--dataset_base_path", "media", "--dataset_metadata_path", "metadata.csv"]


def options(*flags):
    return resolve_options([*REQUIRED, *flags])


class Tiny(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.frozen = torch.nn.Linear(3, 3).to(dtype).requires_grad_(False)
        self.lora_A = torch.nn.Parameter(torch.randn(2, 3, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.randn(3, 2, dtype=dtype))


def test_defaults_keep_todays_run_and_the_flags_parse_from_the_command_line_and_a_preset(tmp_path):
    default = options()
    assert (default.ema_decay, default.ema_warmup, default.validate_with) == (None, True, "raw")
    given = options("--ema-decay", "0.999", "--ema_warmup", "false", "--validate_with", "both")
    assert (given.ema_decay, given.ema_warmup, given.validate_with) == (0.999, False, "both")
    preset = tmp_path / "preset.yaml"
    preset.write_text("ema_decay: 0.99\nema_warmup: false\nvalidate_with: ema\n")
    from_file = options("--config", str(preset))
    assert (from_file.ema_decay, from_file.ema_warmup, from_file.validate_with) == (0.99, False, "ema")


@pytest.mark.parametrize("flags, named", [
    (["--ema_decay", "1"], "--ema_decay"), (["--ema_decay", "0"], "--ema_decay"),
    (["--ema_decay", "nan"], "--ema_decay"), (["--validate_with", "ema"], "--validate_with ema needs --ema_decay"),
    (["--ema_decay", "0.9", "--validate_with", "shadow"], "--validate_with must be one of raw, ema, both"),
])
def test_bad_values_are_refused_naming_the_flag(flags, named):
    with pytest.raises(OptionsError, match=named):
        options(*flags)


def test_decay_with_and_without_warm_up():
    assert [decay_at(0.999, n, warmup=False) for n in (0, 5, 10_000)] == [0.999] * 3
    assert [decay_at(0.999, n, warmup=True) for n in (0, 1, 2)] == [1 / 10, 2 / 11, 3 / 12]
    assert decay_at(0.9, 1000, warmup=True) == 0.9   # capped by --ema_decay


def test_file_names_and_which_weights_are_evaluated():
    assert ema_twin_name("lora.safetensors") == "lora_ema.safetensors"
    assert ema_twin_name("step-12.safetensors") == "step-12_ema.safetensors"
    assert weights_for("raw", 5) == ["raw"] and weights_for("ema", 0) == ["ema"]
    assert weights_for("both", 3) == ["raw", "ema"]
    assert weights_for("both", 0) == ["raw"]   # before the first update the EMA is the initial LoRA


def test_the_shadow_is_fp32_of_the_trainable_weights_and_skipped_steps_are_left_out():
    torch.manual_seed(0)
    module = Tiny(torch.bfloat16)
    ema = LoraEma(module, decay=0.5, warmup=False)
    assert list(ema.tensors()) == ["lora_A", "lora_B"]
    assert all(value.dtype == torch.float32 for value in ema.tensors().values())
    start = {name: value.clone() for name, value in ema.tensors().items()}
    with torch.no_grad():
        module.lora_A.add_(1.0)
    assert not ema.after_step(skipped=True)
    assert ema.updates == 0 and torch.equal(ema.tensors()["lora_A"], start["lora_A"])
    assert ema.after_step(skipped=False) and ema.updates == 1
    expected = 0.5 * start["lora_A"] + 0.5 * module.lora_A.detach().float()
    torch.testing.assert_close(ema.tensors()["lora_A"], expected, rtol=0, atol=1e-6)
    assert torch.equal(ema.tensors()["lora_B"], start["lora_B"])   # unchanged weights: unchanged average


def test_swapping_the_ema_in_restores_the_raw_weights_exactly_even_after_an_error():
    torch.manual_seed(1)
    module = Tiny()
    ema = LoraEma(module, decay=0.9)
    with torch.no_grad():
        module.lora_A.mul_(3.7).add_(0.123456789)
    raw = {name: parameter.detach().clone() for name, parameter in module.named_parameters()}
    with ema.weights("ema"):
        assert torch.equal(module.lora_A, ema.tensors()["lora_A"])
        assert not torch.equal(module.lora_A, raw["lora_A"])
    assert all(torch.equal(parameter, raw[name]) for name, parameter in module.named_parameters())
    with pytest.raises(RuntimeError, match="boom"):
        with ema.weights("ema"):
            raise RuntimeError("boom")
    assert all(torch.equal(parameter, raw[name]) for name, parameter in module.named_parameters())
    with ema.weights("raw"):
        assert torch.equal(module.lora_A, raw["lora_A"])


def test_the_checkpoint_state_comes_back_bit_for_bit_and_a_mismatch_is_refused(tmp_path):
    torch.manual_seed(2)
    module = Tiny()
    ema = LoraEma(module, decay=0.99)
    for _ in range(3):
        with torch.no_grad():
            module.lora_B.add_(torch.randn_like(module.lora_B))
        ema.after_step(skipped=False)
    ema.save_state(tmp_path)
    again = LoraEma(Tiny(), decay=0.99)
    assert again.load_state(tmp_path) and again.updates == 3
    assert all(torch.equal(again.tensors()[name], value) for name, value in ema.tensors().items())
    assert not LoraEma(Tiny(), decay=0.99).load_state(tmp_path / "elsewhere")   # a checkpoint without one

    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lora_A = torch.nn.Parameter(torch.zeros(4, 3))
            self.lora_B = torch.nn.Parameter(torch.zeros(3, 4))

    with pytest.raises(OptionsError, match=f"{EMA_STATE}: the EMA does not match this run's LoRA"):
        LoraEma(Other(), decay=0.99).load_state(tmp_path)


def test_a_resume_with_other_ema_settings_is_a_difference_named():
    saved = run_fingerprint(options(), world_size=1, accumulation=1, rows=1, metadata_sha256="x", image_batch=1,
                            precision="no")
    current = run_fingerprint(options("--ema_decay", "0.99"), world_size=1, accumulation=1, rows=1,
                              metadata_sha256="x", image_batch=1, precision="no")
    assert fingerprint_differences(saved, current) == ["ema: checkpoint None, this run [0.99, True]"]
    assert fingerprint_differences({k: v for k, v in saved.items() if k != "ema"}, current) == []   # older ones


@pytest.mark.slow
def test_an_ema_run_trains_the_raw_lora_bit_for_bit_and_writes_the_average_beside_it(tmp_path, monkeypatch):
    """In-process, one rank, the tiny model: with --ema_decay and --validate_with both (the EMA swapped in for every
    validation) the raw LoRA, its step files and raw validation losses are exactly those of a run without."""
    from diffsynth_mbc.data.demo import prepare
    from diffsynth_mbc.training.cli import main

    monkeypatch.chdir(tmp_path)
    data = prepare(tmp_path / "data", num_videos=2, num_images=2)
    val = prepare(tmp_path / "val", num_videos=1, num_images=1)
    runs = {}
    for name, extra in (("plain", []), ("ema", ["--ema_decay", "0.9", "--validate_with", "both"])):
        flags = ["--config", str(REPO / "configs" / "train_demo.yaml"),
                 "--dataset_base_path", str(tmp_path / "data" / "catalog"), "--dataset_metadata_path", str(data),
                 "--output_path", str(tmp_path / name / "lora"), "--log_dir", str(tmp_path / name / "logs"),
                 "--num_epochs", "1", "--dataset_repeat", "1", "--save_steps", "1", "--val_metadata_path", str(val),
                 "--val_base_path", str(tmp_path / "val" / "catalog"), "--val_steps", "1", "--val_samples", "2",
                 "--run_id", name, *extra]
        assert main(flags) == 0
        runs[name] = tmp_path / name / "lora"
    plain, ema = runs["plain"], runs["ema"]
    for file in ("step-1.safetensors", "step-2.safetensors", "lora.safetensors"):
        expected, actual = load_file(str(plain / file)), load_file(str(ema / file))
        assert expected.keys() == actual.keys() and all(torch.equal(actual[k], expected[k]) for k in expected), file
    assert not list(plain.glob("*_ema.safetensors"))
    assert sorted(p.name for p in ema.glob("*_ema.safetensors")) == [   # the best LoRA's EMA twin too
        "epoch-001_ema.safetensors", "lora-best_ema.safetensors", "lora_ema.safetensors", "step-1_ema.safetensors",
        "step-2_ema.safetensors"]

    # The average, from the raw files: B starts at zero (alpha = rank here, so the file holds B as trained);
    # update 0 decays by min(0.9, 1/10), update 1 by min(0.9, 2/11).
    raw1, raw2 = load_file(str(ema / "step-1.safetensors")), load_file(str(ema / "step-2.safetensors"))
    average = load_file(str(ema / "lora_ema.safetensors"))
    assert average.keys() == raw2.keys()
    for key in (k for k in raw2 if k.endswith("lora_B.weight")):
        first = 0.9 * raw1[key]
        torch.testing.assert_close(average[key], first + (1 - 2 / 11) * (raw2[key] - first), rtol=0, atol=1e-7)
    assert any(not torch.equal(average[key], raw2[key]) for key in raw2)
    assert all(torch.equal(load_file(str(ema / "step-2_ema.safetensors"))[key], average[key]) for key in average)

    def validation(name):
        lines = (tmp_path / name / "logs" / "training_gpu0.jsonl").read_text().splitlines()
        return [record for record in map(json.loads, lines) if record.get("kind") == "val"]

    assert [line["val_loss"] for line in validation("ema")] == [line["val_loss"] for line in validation("plain")]
    assert all("val_loss_ema" not in line for line in validation("plain"))
    assert [line["step"] for line in validation("ema") if "val_loss_ema" in line] == [1, 2]
    state = json.loads((tmp_path / "ema" / "logs" / "training_gpu0.json").read_text())
    assert state["val_loss_ema"] == validation("ema")[-1]["val_loss_ema"]
    checkpoint = sorted((ema / "checkpoints").glob("step-*"))[-1]
    assert (checkpoint / EMA_STATE).is_file() and not (sorted((plain / "checkpoints").glob("step-*"))[-1]
                                                         / EMA_STATE).exists()
