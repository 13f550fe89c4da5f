"""One spelling for every flag of every command (underscores shown, dashes accepted) and one line for an unknown one."""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess

import pytest

from catalog_helpers import clip, write_metadata
from diffsynth_mbc import install
from diffsynth_mbc.data import convert, demo
from diffsynth_mbc.data.cache import cli as cache_cli
from diffsynth_mbc.doctor import cli as doctor_cli
from diffsynth_mbc.lifecycle import stop_command, supervisor
from diffsynth_mbc.monitor import cli as monitor_cli
from diffsynth_mbc.training import options
from diffsynth_mbc.training.lora import export
from diffsynth_mbc.training.plan import command as plan
from diffsynth_mbc.sample import cli as sample_cli
from e2e_helpers import REPO, a_preset_s_files, a_value_for, isolated_env

# Every `python -m diffsynth_mbc.X` and the function that builds its parser.
ENTRY_POINTS = {
    "convert": convert.build_parser, "monitor": monitor_cli.build_parser, "doctor": doctor_cli.build_parser,
    "install": install.build_parser, "export": export.build_parser, "cache": cache_cli.build_parser, "plan": plan.build_parser,
    "stop": stop_command.build_parser, "supervise": supervisor.build_parser, "train": options.build_parser,
    "demo": demo.build_parser, "sample": sample_cli.build_parser,
}
LAUNCHER = str(REPO / "launchers" / "train_test.sh")


def test_the_list_above_names_every_entry_point():
    package = REPO / "diffsynth_mbc"
    modules = {path.stem for path in package.glob("*.py") if 'if __name__ == "__main__"' in path.read_text()}
    modules |= {path.parent.name for path in package.glob("*/__main__.py")}
    assert modules == set(ENTRY_POINTS)


def groups_of(parser: argparse.ArgumentParser, action: argparse.Action) -> set[int]:
    return {id(group) for group in parser._mutually_exclusive_groups if action in group._group_actions}


def required_args(parser, leaving_out: argparse.Action) -> list[str]:
    """Values for what the parser requires, except what conflicts with the flag under test."""
    argv, satisfied = [], set()
    for action in parser._actions:
        if action is leaving_out or groups_of(parser, action) & groups_of(parser, leaving_out):
            continue
        if not action.option_strings:
            argv += [] if action.nargs in ("*", "?", argparse.REMAINDER) else ["some/path"]
        elif action.required:
            argv += [action.option_strings[0], *a_value_for(action)]
    for group in parser._mutually_exclusive_groups:
        if group.required and id(group) not in groups_of(parser, leaving_out) | satisfied:
            first = group._group_actions[0]
            argv += [first.option_strings[0], *a_value_for(first)]
            satisfied.add(id(group))
    return argv


def built(entry: str) -> argparse.ArgumentParser:
    """The entry point's parser, its flags spelled as --help shows them."""
    parser = ENTRY_POINTS[entry]()
    parser.format_help()
    return parser


def every_flag():
    for name in ENTRY_POINTS:
        parser = built(name)
        subcommands = [(choice, sub) for action in parser._actions if isinstance(action, argparse._SubParsersAction)
                       for choice, sub in action.choices.items()]
        for prefix, owner in [((), parser)] + [((choice,), sub) for choice, sub in subcommands]:
            for action in owner._actions:
                long = [flag for flag in action.option_strings if flag.startswith("--") and flag != "--help"]
                if long and not isinstance(action, argparse._HelpAction):
                    yield pytest.param(name, prefix, long[0], id=f"{name}{''.join(' ' + p for p in prefix)} {long[0]}")


@pytest.mark.parametrize("entry,prefix,flag", list(every_flag()))
def test_both_spellings_of_every_flag_read_the_same_value(entry, prefix, flag):
    parser = built(entry)
    owner = parser
    for choice in prefix:
        owner = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[choice]
    action = next(a for a in owner._actions if flag in a.option_strings)
    underscore, dash = "--" + flag[2:].replace("-", "_"), "--" + flag[2:].replace("_", "-")
    assert underscore in action.option_strings, f"{entry}: {flag} is not shown with underscores"
    base = [*prefix, *required_args(owner, action)]
    value = a_value_for(action)

    def read(spelling):
        # the required arguments first: a flag of several values (sample's --lora) would take a positional after it
        parsed, _ = ENTRY_POINTS[entry]().parse_known_args([*prefix, *base[len(prefix):], spelling, *value])
        return vars(parsed)

    with_underscores, with_dashes = read(underscore), read(dash)
    assert with_underscores == with_dashes
    assert action.dest in with_underscores and with_underscores[action.dest] != action.default, f"{entry}: {flag}"
    help_text = ENTRY_POINTS[entry]().format_help()
    if dash != underscore:
        assert dash not in help_text.replace(underscore, ""), f"{entry} --help shows {dash}"


def train_error(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        options.resolve_options(["--config", str(REPO / "configs" / "train_demo.yaml"), *argv])
    return exit_.value.code, capsys.readouterr().err


def test_a_dashed_training_flag_is_the_same_flag(tmp_path):
    demo_preset = str(REPO / "configs" / "train_demo.yaml")
    dashed = options.resolve_options(["--config", demo_preset, "--learning-rate", "5e-5", "--num-epochs=2"])
    assert dashed.learning_rate == 5e-5 and dashed.num_epochs == 2


@pytest.mark.parametrize("typed,line", [
    ("--num_epoch", "error: unknown flag --num_epoch: did you mean --num_epochs? "
                    "(full list: python -m diffsynth_mbc.train --help)"),
    ("--lr", "error: unknown flag --lr: did you mean --learning_rate? (full list: python -m diffsynth_mbc.train --help)"),
    ("--resume-latest", "error: unknown flag --resume-latest: did you mean --resume latest? "
                        "(full list: python -m diffsynth_mbc.train --help)"),
])
def test_an_unknown_training_flag_is_one_line_with_the_closest_real_ones(capsys, typed, line):
    code, err = train_error(capsys, typed, *([] if typed == "--resume-latest" else ["3"]))
    assert code == 2 and err == line + "\n"


def test_a_prefix_is_never_taken_for_the_flag_it_begins(capsys):
    """--num_epoch is refused with the suggestion, not read as --num_epochs: a typo never picks a setting."""
    for entry, build in ENTRY_POINTS.items():
        assert build().allow_abbrev is False, entry
    code, err = train_error(capsys, "--dataset_base", "x")
    assert code == 2 and "did you mean --dataset_base_path?" in err and len(err.splitlines()) == 1


def test_other_usage_errors_are_one_line_too(capsys):
    code, err = train_error(capsys, "--height", "tall")
    assert code == 2 and err.count("\n") == 1 and "--height" in err and "invalid int value" in err


def test_commands_that_pass_flags_on_suggest_from_both_lists(capsys):
    """The doctor and the plan take their own flags and pass the rest to the training's: a typo in either is
    caught there, with suggestions from both and both lists named."""
    with pytest.raises(SystemExit) as exit_:
        doctor_cli.parse(["--config", str(REPO / "configs" / "train_demo.yaml"), "--probes", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: unknown flag --probes: did you mean --probe?")
    assert "python -m diffsynth_mbc.doctor --help" in err and "python -m diffsynth_mbc.train --help" in err
    assert plan.main(["--world_size", "2", "--paths-only", "--config", str(REPO / "configs" / "train_demo.yaml"),
                      "--learning-rate", "1e-3"]) == 0
    with pytest.raises(SystemExit):
        plan.main(["--world_size", "2", "--paths_only", "--lr", "1e-3"])
    assert "did you mean --learning_rate?" in capsys.readouterr().err


def test_the_plan_counts_gpus_as_the_launchers_and_the_doctor_do(tmp_path, capsys):
    """`plan --world_size` where everything else says --gpus, and `plan --gpu` got no did-you-mean (the plan had
    no --gpus to suggest)."""
    demo_preset = str(REPO / "configs" / "train_demo.yaml")
    with pytest.raises(SystemExit) as exit_:
        plan.main(["--gpu", "2", "--paths-only", "--config", demo_preset])
    assert exit_.value.code == 2 and "unknown flag --gpu: did you mean --gpus?" in capsys.readouterr().err
    help_text = plan.build_parser().format_help()
    assert "--gpus" in help_text and "--nodes" in help_text and "--world_size" not in help_text
    metadata = write_metadata(tmp_path / "metadata.csv", [clip("v.mp4")] * 9)
    flags = ["--config", demo_preset, "--dataset_metadata_path", str(metadata), "--output_path", str(tmp_path / "o")]
    printed = []
    for counts in (["--gpus", "2", "--nodes", "2"], ["--world_size", "4", "--nodes", "2"]):   # the old name still works
        assert plan.main([*counts, *flags]) == 0
        printed.append(capsys.readouterr().err)
    assert printed[0] == printed[1] and "GPUs 4 -> 7 samples per GPU per epoch" in printed[0], printed[0]
    assert plan.main(["--config", demo_preset, "--dataset_metadata_path", str(metadata)]) == 2
    assert "--gpus N is required" in capsys.readouterr().err


def test_a_subcommand_flag_is_suggested_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(["prepare", "somewhere", "--vidoes", "3"])
    assert exit_.value.code == 2 and "did you mean --videos?" in capsys.readouterr().err


def launcher(work, *args, **env):
    return subprocess.run(["bash", LAUNCHER, *args], cwd=work, capture_output=True, text=True, timeout=120,
                          env=isolated_env(work, **env))


LAUNCHER_FLAGS = [["--deepspeed"], ["--multinode"], ["--gpus", "3"], ["--cached"], ["--detach"],
                  ["--skip_doctor"]]


def spelled(flag: str, dashes: bool) -> str:
    return "--" + flag[2:].replace("_", "-") if dashes else flag


@pytest.mark.slow   # starts a Python process that imports torch
def test_both_spellings_of_every_launcher_flag_read_the_same(tmp_path):
    env = dict(MODEL_DIR="models/Wan2.2-TI2V-5B", MASTER_ADDR="127.0.0.1", NUM_MACHINES="2", MACHINE_RANK="1")
    help_text = launcher(tmp_path, "--help", **env).stdout
    shown = re.findall(r"^  (--[a-z_-]+)", help_text.split("Training flags")[0], re.M)
    assert set(shown) == {flag for flag, *_ in LAUNCHER_FLAGS} | {"--demo", "--dry_run", "--help"}, shown
    a_preset_s_files(tmp_path)   # a launch, dry or not, checks every path it reads
    outputs = []
    for dashes in (False, True):
        flat = [part for flag, *value in LAUNCHER_FLAGS for part in (spelled(flag, dashes), *value)]
        result = launcher(tmp_path, spelled("--dry_run", dashes), *flat, "--dataset_base_path",
                          "media", **env)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]
    plain = launcher(tmp_path, "--dry_run", "--gpus", "2", "--dataset_base_path", "media", **env)
    assert plain.returncode == 0, plain.stderr
    assert "launcher flags: demo=0 deepspeed=1 multinode=1 gpus=3 cached=1 detach=1 skip_doctor=1" in outputs[0]
    assert "launcher flags: demo=0 deepspeed=0 multinode=0 gpus=2 cached=0 detach=0 skip_doctor=0" in plain.stdout
    demo = launcher(tmp_path, "--demo", "--dry-run", NUM_GPUS="1")   # --demo is one word: one spelling
    assert demo.returncode == 0 and "launcher flags: demo=1 " in demo.stdout, demo.stderr
    assert not (tmp_path / "runs").exists()   # a dry run creates nothing


@pytest.mark.parametrize("typed,suggestion", [("--lr", "--learning_rate"), ("--dry-runn", "--dry_run"),
                                              ("--num_epoch", "--num_epochs")])
def test_the_launcher_refuses_an_unknown_flag_in_one_line_before_anything_starts(tmp_path, typed, suggestion):
    result = launcher(tmp_path, "--demo", typed, "3")
    assert result.returncode == 2
    assert result.stderr == (f"error: unknown flag {typed}: did you mean {suggestion}? "
                             f"(full list: bash {LAUNCHER} --help)\n")   # the launcher as typed
    assert not (tmp_path / "runs").exists()   # nothing locked, prepared or started


def test_the_launcher_sees_a_dashed_model_folder(tmp_path):
    """--model-dir is --model_dir: without a GPU the launcher must not fall back to the demo over it."""
    a_preset_s_files(tmp_path)
    result = launcher(tmp_path, "--dry_run", "--gpus", "1", "--model-dir", "models/Wan2.2-TI2V-5B",
                      "--dataset_base_path", "media", NUM_GPUS="0")
    assert result.returncode == 0, result.stderr
    assert "running the built-in demo" not in result.stderr and "demo=0" in result.stdout
    assert "--model-dir models/Wan2.2-TI2V-5B" in result.stdout.splitlines()[0]


@pytest.mark.parametrize("value", ["-inf", "-Infinity", "-nan", "-1e3", "-2.5E-4", "-.5", "-5"])
def test_a_negative_number_or_infinity_is_the_flags_value_for_its_own_check_to_refuse(value):
    """``--i2v_probability -inf`` reached argparse's "expected one argument" before: -inf looked like a flag."""
    from diffsynth_mbc.training.options.parser import build_parser

    assert build_parser().parse_args(["--i2v_probability", value]).i2v_probability == pytest.approx(float(value),
                                                                                                  nan_ok=True)
    with pytest.raises(SystemExit):   # a word after a flag is still a flag
        build_parser().parse_args(["--i2v_probability", "-x"])
