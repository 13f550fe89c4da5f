"""``python -m diffsynth_mbc.sample``'s flags shared with the training: the training's declarations (the same names,
help and checks), their default the run's; a bad value is refused naming the flag before anything loads. Pure: no
model, no run."""

from __future__ import annotations

import pytest

from diffsynth_mbc.sample import cli
from diffsynth_mbc.sample.sweep import sweep_options
from diffsynth_mbc.training.evaluation.validation import validation_settings
from diffsynth_mbc.training.options import DECLARATIONS, build_parser as training_parser
from diffsynth_mbc.training.options.run_options import TrainOptions

SHARED = ["demo", "model_dir", "model_id", "seed", "height", "width", "num_frames", "mixed_precision",
          "val_metadata_path", "val_base_path", "val_samples", "val_timestep_quantiles"]


def test_the_shared_flags_are_the_training_s_with_the_run_s_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")
    sample_help, training_help = cli.build_parser().format_help(), training_parser().format_help()
    assert [declaration.name for declaration in cli.SHARED] == sorted(SHARED, key=list(DECLARATIONS).index)
    for name in SHARED:
        declaration = DECLARATIONS[name]
        assert f"{declaration.help} (default: the run's" in sample_help, name   # the training's, the run's default
        assert declaration.help in training_help, name
    assert "(default: the run's, else 704)" in sample_help and "(default: the run's, else 0.1,0.3,0.5,0.7,0.9)" in \
        sample_help
    assert "none: unset" not in sample_help   # an unset flag is the run's value here, not a preset's cleared


@pytest.mark.parametrize("flag,value,said", [
    ("--height", "0", "--height must be a positive integer, got 0"),
    ("--val_samples", "-2", "--val_samples must be a positive integer, got -2"),
    ("--mixed_precision", "fp8", "--mixed_precision must be one of auto, bf16, fp16, fp32, got 'fp8'"),
    ("--val_timestep_quantiles", "0.5,2", "--val_timestep_quantiles must be comma-separated numbers in [0, 1), "
                                          "got '0.5,2'"),
])
def test_a_bad_shared_value_is_refused_naming_the_flag_before_anything_loads(tmp_path, capsys, flag, value, said):
    code = cli.main([str(tmp_path / "prompts.yaml"), "--lora", str(tmp_path / "nothing"), "--output",
                     str(tmp_path / "out"), flag, value])
    assert code == 2 and capsys.readouterr().err.strip() == f"error: {said}"
    assert not (tmp_path / "out").exists()


def test_given_values_are_typed_as_the_training_s_and_measured_with_as_a_run_records_them(tmp_path):
    args = cli.build_parser().parse_args([str(tmp_path / "p.yaml"), "--lora", "x", "--output", str(tmp_path / "o"),
                                          "--val_timestep_quantiles", "0.25,0.75", "--height", "64", "--demo"])
    run = TrainOptions(val_metadata_path="val.csv", val_timestep_quantiles="0.5", height=704, seed=7)
    options = sweep_options(args, cli.given_settings(args), run)
    assert options.val_timestep_quantiles == (0.25, 0.75) and (options.height, options.seed) == (64, 7)
    assert options.demo and options.output_path == str(tmp_path / "o")
    assert validation_settings(options) == {"val_metadata_path": "val.csv", "val_base_path": None, "val_cache": None,
                                             "val_samples": 16,
                                             "val_timestep_quantiles": "0.25,0.75", "seed": 7, "height": 64,
                                             "width": 1280, "num_frames": 17, "buckets": "off"}
