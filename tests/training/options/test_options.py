import pytest

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.options import DEFAULTS, load_preset, resolve_options
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
REQUIRED = ["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv"]


def test_defaults_are_the_users_settings():
    options = resolve_options(REQUIRED)
    assert (options.width, options.height, options.num_frames) == (1280, 704, 17)
    assert options.lora_rank == 32 and options.lora_target_modules == ("q", "k", "v", "o", "ffn.0", "ffn.2")
    assert options.lora_target_modules.text == "q,k,v,o,ffn.0,ffn.2"   # as a LoRA file's metadata names them
    assert options.learning_rate == 1e-4 and options.batch_size == 1


def test_command_line_beats_preset(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("dataset_base_path: a\ndataset_metadata_path: b.csv\nlearning_rate: 1.0e-5\nnum_epochs: 3\n")
    options = resolve_options(["--config", str(preset), "--num_epochs", "7"])
    assert options.learning_rate == 1e-5 and options.num_epochs == 7


def test_none_on_the_command_line_clears_a_number_the_preset_set_and_only_such_a_number():
    full = ["--config", str(REPO / "configs" / "train_full.yaml")]
    with pytest.raises(OptionsError, match="--val_steps none trains without validation"):
        resolve_options([*full, "--val_metadata_path", ""])   # the preset's val_steps: 2000 stays
    options = resolve_options([*full, "--val_metadata_path", "", "--val_steps", "none", "--checkpoint_minutes", "None",
                               "--lora_alpha", "none", "--early_stop", "off"])   # the preset's early stop needs them
    assert options.val_steps is None and options.checkpoint_minutes is None and options.lora_alpha is None
    assert options.checkpoint_steps == 2000 and options.num_epochs == 5   # the rest of the preset as it was
    with pytest.raises(SystemExit):
        resolve_options([*full, "--num_epochs", "none"])   # a number every run needs cannot be unset


def test_preset_values_are_typed_like_flags(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("dataset_base_path: a\ndataset_metadata_path: b.csv\nlearning_rate: 1e-5\n")  # a YAML string
    assert resolve_options(["--config", str(preset)]).learning_rate == 1e-5


def test_unknown_preset_key_is_named_with_its_file(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("dataset_base_path: a\nlearnig_rate: 1\n")
    with pytest.raises(OptionsError, match="learnig_rate") as error:
        resolve_options(["--config", str(preset)])
    assert "p.yaml" in str(error.value)


def test_unreadable_preset_value_names_the_key(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("dataset_base_path: a\ndataset_metadata_path: b\nlora_rank: many\n")
    with pytest.raises(OptionsError, match="lora_rank"):
        resolve_options(["--config", str(preset)])


@pytest.mark.parametrize("flags,named", [
    (["--height", "700"], "--height"),
    (["--num_frames", "16"], "--num_frames"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps"),
    (["--learning_rate", "0"], "--learning_rate"),
    (["--lora_target_modules", "q,,v"], "--lora_target_modules"),
    (["--demo", "--model_dir", "m"], "--demo"),
])
def test_bad_values_name_the_flag(flags, named):
    with pytest.raises(OptionsError, match=named):
        resolve_options(REQUIRED + flags)


@pytest.mark.parametrize("flags,named", [
    (["--lora_alpha", "nan"], "--lora_alpha"), (["--lora_alpha", "0"], "--lora_alpha"),
    (["--lora_alpha", "-4"], "--lora_alpha"), (["--learning_rate", "nan"], "--learning_rate"),
    (["--learning_rate", "inf"], "--learning_rate"), (["--max_grad_norm", "nan"], "--max_grad_norm"),
    (["--max_grad_norm", "-1"], "--max_grad_norm"), (["--weight_decay", "nan"], "--weight_decay"),
    (["--weight_decay", "-0.1"], "--weight_decay"), (["--status_interval_s", "0"], "--status_interval_s"),
    (["--stop_grace_s", "-1"], "--stop_grace_s"), (["--print_every_s", "nan"], "--print_every_s"),
    (["--checkpoint_minutes", "nan"], "--checkpoint_minutes"), (["--seed", "-1"], "--seed"),
    (["--max_timestep_boundary", "1.5"], "--max_timestep_boundary"),
    (["--min_timestep_boundary", "0.8", "--max_timestep_boundary", "0.2"], "--min_timestep_boundary"),
    (["--min_timestep_boundary", "0.5", "--max_timestep_boundary", "0.5"], "--min_timestep_boundary"),
    (["--run_id", "a/b"], "--run_id"), (["--run_id", ".."], "--run_id"), (["--run_id", "../x"], "--run_id"),
    (["--run_id", ""], "--run_id"), (["--lora_target_modules", "q k"], "--lora_target_modules"),
    (["--dataset_num_workers", "-1"], "--dataset_num_workers"), (["--save_steps", "0"], "--save_steps"),
])
def test_values_that_would_poison_a_run_are_refused(flags, named):
    with pytest.raises(OptionsError, match=named):
        resolve_options(REQUIRED + flags)


@pytest.mark.parametrize("key,value", [("lora_alpha", True), ("lora_rank", True), ("learning_rate", ".nan")])
def test_preset_values_are_checked_like_flags(tmp_path, key, value):
    preset = tmp_path / "p.yaml"
    preset.write_text(f"dataset_base_path: a\ndataset_metadata_path: b\n{key}: {str(value).lower()}\n")
    with pytest.raises(OptionsError, match=f"--{key}"):
        resolve_options(["--config", str(preset)])


def test_edge_values_that_are_fine_pass():
    options = resolve_options(REQUIRED + ["--max_grad_norm", "0", "--weight_decay", "0", "--lora_alpha", "0.5",
                                          "--min_timestep_boundary", "0.875", "--max_timestep_boundary", "0.9",
                                          "--run_id", "run-20250101.a_b", "--seed", "0"])
    assert options.max_grad_norm == 0 and options.run_id == "run-20250101.a_b"


def test_a_run_id_from_the_environment_is_checked_too(tmp_path):
    import subprocess
    import sys

    from e2e_helpers import isolated_env

    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.train", *REQUIRED, "--output_path",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                            env={**isolated_env(tmp_path), "MBC_RUN_ID": "../escape"}, cwd=tmp_path)
    assert result.returncode == 2 and "MBC_RUN_ID" in result.stderr and "'../escape'" in result.stderr
    assert not (tmp_path / "out").exists()


def test_metadata_is_required():
    with pytest.raises(OptionsError, match="--dataset_metadata_path"):
        resolve_options(["--dataset_base_path", "x"])


@pytest.mark.parametrize("preset", sorted((REPO / "configs").glob("train_*.yaml")), ids=lambda p: p.name)
def test_every_shipped_preset_loads_and_validates(preset):
    assert set(load_preset(preset)) <= set(DEFAULTS)
    options = resolve_options(["--config", str(preset)])
    assert options.height % 32 == 0 and options.num_frames % 4 == 1


def test_presets_hold_the_users_settings():
    for name, rows_note, epochs in (("train_test.yaml", "5000", 1), ("train_full.yaml", "170,180", 5)):
        options = resolve_options(["--config", str(REPO / "configs" / name)])
        assert (options.width, options.height, options.num_frames) == (1280, 704, 17)
        assert options.lora_rank == 32 and options.lora_target_modules.text == "q,k,v,o,ffn.0,ffn.2"
        assert options.learning_rate == 1e-4 and options.batch_size == 1 and options.num_epochs == epochs
        assert rows_note in (REPO / "configs" / name).read_text()


def test_an_output_folder_that_is_a_file_and_absurd_sizes_are_usage_errors(tmp_path):
    from diffsynth_mbc.errors import OptionsError
    from diffsynth_mbc.training.options import resolve_options

    base = ["--dataset_base_path", str(tmp_path), "--dataset_metadata_path", str(tmp_path / "m.csv")]
    a_file = tmp_path / "lora.safetensors"
    a_file.write_bytes(b"x")
    for flag in ("--output_path", "--log_dir", "--checkpoint_dir"):
        with pytest.raises(OptionsError, match=f"{flag} .* is a file, not a folder"):
            resolve_options([*base, flag, str(a_file)])
    with pytest.raises(OptionsError, match="--height 32000 is above 4096"):
        resolve_options([*base, "--height", "32000", "--width", "32000"])


def test_the_doctor_refuses_to_decode_a_row_that_would_not_fit_in_memory():
    from diffsynth_mbc.doctor.checks import decode_memory_problem

    problem = decode_memory_problem(4096, 4096, 17, available=4 * 2**30)
    assert "at 4096x4096x17 needs about 3.2 GiB, more than half of the 4.0 GiB free" in problem
    assert decode_memory_problem(1280, 704, 17, available=8 * 2**30) is None
    assert decode_memory_problem(4096, 4096, 17, available=None) is None


def test_none_clears_a_file_the_preset_names_that_a_run_may_go_without():
    """``--val_metadata_path none`` was a file named "none" to the plan and missing to the launcher: now it clears
    the preset's catalogue, and the preset's --val_steps is refused the same way by both."""
    full = ["--config", str(REPO / "configs" / "train_full.yaml")]
    with pytest.raises(OptionsError, match="--val_steps none trains without validation"):
        resolve_options([*full, "--val_metadata_path", "none"])
    options = resolve_options([*full, "--val_metadata_path", "none", "--val_steps", "none", "--sample_prompts", "None",
                               "--cache", "none", "--early_stop", "off"])
    with pytest.raises(OptionsError, match="--early_stop needs a validation to decide on: .*, or --early_stop off"):
        resolve_options([*full, "--val_metadata_path", "none", "--val_steps", "none"])
    assert options.val_metadata_path is None and options.sample_prompts is None and options.cache is None
    assert resolve_options([*full, "--val_metadata_path", "nonesuch.csv"]).val_metadata_path == "nonesuch.csv"


def test_a_presets_log_and_checkpoint_folders_follow_an_output_folder_given_alone(tmp_path, capsys):
    """Changing only --output_path left the demo's logs in the preset's runs/demo/training_logs, where another run
    writes its own. The folders follow the output folder unless given; the launcher reads them from the plan."""
    from diffsynth_mbc.training.plan.command import main as plan_main

    demo = ["--config", str(REPO / "configs" / "train_demo.yaml")]
    preset = resolve_options(demo)
    assert (preset.log_dir, preset.checkpoint_dir) == ("runs/demo/training_logs", "runs/demo/lora/checkpoints")
    moved = resolve_options([*demo, "--output_path", "runs/x/lora"])
    assert (moved.log_dir, moved.checkpoint_dir) == ("runs/x/lora/training_logs", "runs/x/lora/checkpoints")
    given = resolve_options([*demo, "--output_path", "runs/x/lora", "--log_dir", "logs/x", "--checkpoint_dir", "c"])
    assert (given.log_dir, given.checkpoint_dir) == ("logs/x", "c")
    same = resolve_options([*demo, "--output_path", "runs/demo/lora"])   # the preset's own output: its folders
    assert same.log_dir == "runs/demo/training_logs"
    preset_file = tmp_path / "mine.yaml"
    preset_file.write_text("dataset_base_path: media\ndataset_metadata_path: m.csv\noutput_path: out/a\n"
                           "log_dir: out/a-logs\ncheckpoint_dir: out/a-checkpoints\n")
    assert resolve_options(["--config", str(preset_file), "--output_path", "out/b"]).checkpoint_dir == \
        "out/b/checkpoints"
    assert plan_main(["--paths-only", "--gpus", "2", *demo, "--output_path", "runs/x/lora"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "LOG_DIR=runs/x/lora/training_logs" in printed and "CHECKPOINT_DIR=runs/x/lora/checkpoints" in printed
