"""Each option declared once (``TrainOptions``' fields, ``training/options/declaration.py``): the command line, its help
and the checks come from the declarations, the help names each option's real default, and the list options are
parsed once into typed values that keep the text they were given as. Pure: no torch, no run."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re

import pytest

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.flags import flags_of
from diffsynth_mbc.training.options import DECLARATIONS, build_parser, resolve_options
from diffsynth_mbc.training.options.run_options import TrainOptions
from diffsynth_mbc.training.options.run_record import RUN_OPTIONS, read_run_options

REQUIRED = ["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv"]


def help_of_each_flag(parser, monkeypatch) -> dict[str, str]:
    """--flag -> its help as ``--help`` prints it (one line each: a wide terminal)."""
    monkeypatch.setenv("COLUMNS", "2000")
    found, flag = {}, None
    for line in parser.format_help().splitlines():
        match = re.match(r"^  (--\w+)(?: \S+)?(?:\s{2,}(.*))?$", line)
        if match:
            flag, found[match[1]] = match[1], match[2] or ""
        elif flag and line.startswith(" " * 6):   # a long flag's help starts on the next line
            found[flag] = f"{found[flag]} {line.strip()}".strip()
        else:
            flag = None
    return found


def said(value) -> str:
    """A default as a reader of the help expects to see it."""
    value = getattr(value, "text", value)   # a list option: the text it was declared with
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "empty" if value == "" else str(value)


def test_every_flag_s_help_names_its_real_default(monkeypatch):
    helps = help_of_each_flag(build_parser(), monkeypatch)
    defaults = TrainOptions()   # the values a run gets from no flag and no preset
    filled = resolve_options(REQUIRED + ["--output_path", "OUTPUT_PATH"])   # what resolving fills in for None
    problems = []
    for field in dataclasses.fields(TrainOptions):
        text, value = helps.get(f"--{field.name}", ""), getattr(defaults, field.name)
        if field.name == "demo":   # a flag without a value
            expected = ["(default off)"]
        elif value is None or getattr(value, "text", "") is None:
            expected = ["(default: "]   # and what it means
        else:
            expected = [f"(default {said(value)})", f"(default {said(value)}; none: "]
        if not any(words in text for words in expected):
            problems.append(f"--{field.name}: {text!r} does not say {expected[0]!r}")
        if len(re.findall(r"\bdefault\b", text, re.IGNORECASE)) != 1:
            problems.append(f"--{field.name}: {text!r} names a default more than once, or none")
        resolved = getattr(filled, field.name)
        given = f"--{field.name}" in REQUIRED
        if value is None and not given and isinstance(resolved, str) and resolved.replace("\\", "/") not in text:
            problems.append(f"--{field.name}: {text!r} does not say what an unset value becomes ({resolved})")
    assert problems == []


def test_the_command_line_is_the_declarations_in_their_groups():
    parser = build_parser()
    assert set(flags_of(parser)) == {"--help", "--config"} | {declaration.flag for declaration in DECLARATIONS.values()}
    for group in parser._action_groups[2:]:
        assert all(DECLARATIONS[action.dest].group == group.title for action in group._group_actions), group.title


@pytest.mark.parametrize("name", [name for name, declaration in DECLARATIONS.items() if declaration.optional])
def test_none_clears_exactly_the_options_declared_optional(name):
    assert build_parser().parse_args([f"--{name}", "none"]).__dict__[name] is None


@pytest.mark.parametrize("flag", ["--num_epochs", "--learning_rate", "--lora_format", "--decoder"])
def test_a_number_or_name_every_run_has_is_not_cleared_by_none(flag):
    with pytest.raises((SystemExit, OptionsError)):
        resolve_options(REQUIRED + [flag, "none"])


@pytest.mark.parametrize("flags,said_", [
    (["--ema_decay", "1"], "--ema_decay must be a finite number above 0 and below 1, got 1.0"),
    (["--logit_mean", "nan"], "--logit_mean must be a finite number, got nan"),
    (["--health_steps", "-1"], "--health_steps must be an integer of 0 or more, got -1"),
    (["--decoder", "slow"], "--decoder must be one of fast, diffsynth, got 'slow'"),
    (["--dist_backend", "mpi"], "--dist_backend must be one of nccl, gloo, got 'mpi'"),
])
def test_ranges_and_choices_are_checked_as_declared(flags, said_):
    with pytest.raises(OptionsError) as error:
        resolve_options(REQUIRED + flags)
    assert str(error.value) == said_


def test_every_path_option_of_a_run_s_record_reads_against_the_folder_it_started_in(tmp_path):
    paths = [name for name, declaration in DECLARATIONS.items() if declaration.path]
    assert {"dataset_base_path", "output_path", "checkpoint_dir", "val_cache", "init_lora"} <= set(paths)
    values = {**TrainOptions().recorded(), **{name: f"relative/{name}" for name in paths}}
    (tmp_path / RUN_OPTIONS).write_text(json.dumps({"cwd": "/started/here", "options": values}))
    read = read_run_options(tmp_path)
    assert {name: getattr(read, name) for name in paths} == {name: f"/started/here/relative/{name}" for name in paths}


def test_list_options_hold_their_values_parsed_once_and_their_text():
    options = resolve_options(REQUIRED + ["--resolution_stages", "832x480:0.70", "--val_timestep_quantiles",
                                          "0.25,0.75", "--lora_target_modules", "q,v"])
    assert [(stage.name, stage.share) for stage in options.resolution_stages] == [("832x480", 0.7)]
    assert options.resolution_stages.text == "832x480:0.70"   # as given: what the fingerprint compares
    assert options.val_timestep_quantiles == (0.25, 0.75) and options.lora_target_modules == ("q", "v")
    assert options.sample_strengths == (1.0,) and options.sample_strengths.text == "1"
    unset = options.replace(resolution_stages=None)
    assert unset.resolution_stages == () and unset.resolution_stages.text is None
    assert TrainOptions(val_timestep_quantiles="0.5").val_timestep_quantiles == (0.5,)   # text, as a record holds it
    copied = pickle.loads(pickle.dumps(options))   # a data-loader worker's copy
    assert copied == options and copied.resolution_stages.text == "832x480:0.70"
    assert json.loads(json.dumps(options.recorded()))["resolution_stages"] == "832x480:0.70"
    with pytest.raises(OptionsError, match=r"^--resolution_stages: '832x480' is not WxH\[xF\]:SHARE"):
        resolve_options(REQUIRED + ["--resolution_stages", "832x480"])
