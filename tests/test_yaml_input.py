"""Every YAML file a user gives is read by one safe loader: an alias bomb is refused at once, naming the file, and no
error message quotes more than a few hundred characters of a value."""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc

import pytest

from diffsynth_mbc.errors import OptionsError, quoted
from diffsynth_mbc.sample_prompts import load_sample_prompts
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.yaml_input import MAX_NODES, YamlInputError, parse_yaml

LAUGHS = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'] + [
    f"{name}: &{name} [{', '.join([f'*{before}'] * 9)}]" for before, name in zip("abcdef", "bcdefg")]


def bomb(path, last: str):
    """Nine lines: 9^7 'lol's through aliases, then ``last`` (which names ``*g``)."""
    path.write_text("\n".join(LAUGHS + [last]) + "\n", encoding="utf-8")
    return path


def refused_quickly(call, path) -> str:
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(OptionsError) as error:
            call()
        took, (_, peak) = time.monotonic() - started, tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(error.value)
    assert took < 0.5 and peak < 5 * 2**20, (took, peak)
    assert str(path) in message and "aliases" in message and len(message) < 400, message[:1000]
    return message


def test_a_billion_laughs_datasets_file_is_refused_at_once_naming_it(tmp_path):
    path = bomb(tmp_path / "datasets.yaml", "datasets: [*g, *g]")
    message = refused_quickly(lambda: resolve_options(["--datasets", str(path), "--output_path", str(tmp_path)]),
                              path)
    assert message.startswith(f"--datasets: {path}: refused: its aliases (*name) add more than 100,000 values")


def test_a_billion_laughs_preset_is_refused_at_once_naming_it(tmp_path):
    path = bomb(tmp_path / "preset.yaml", "lora_target_modules: *g")
    message = refused_quickly(lambda: resolve_options(["--config", str(path)]), path)
    assert message.startswith(f"--config: {path}: refused")


def test_a_billion_laughs_prompt_file_is_refused_at_once_naming_it(tmp_path):
    path = bomb(tmp_path / "prompts.yaml", "prompts: *g")
    refused_quickly(lambda: load_sample_prompts(path, height=64, width=64, num_frames=5, seed=0), path)


def test_the_training_command_refuses_it_with_exit_2_and_a_short_message(tmp_path):
    path = bomb(tmp_path / "datasets.yaml", "datasets: [*g]")
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.train", "--datasets", str(path), "--output_path",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and len(result.stderr) < 1000, result.stderr[:2000]
    assert f"error: --datasets: {path}: refused" in result.stderr


def test_a_document_that_contains_itself_is_refused():
    with pytest.raises(YamlInputError, match="an alias refers to a node that holds it"):
        parse_yaml("datasets: &loop [*loop]\n", "--datasets f.yaml")


def test_aliases_within_reason_and_large_files_without_aliases_load():
    shared = "common: &c {base_path: data, metadata_path: data/metadata.csv}\ndatasets: [*c, *c]\n"
    assert parse_yaml(shared, "f")["datasets"] == [{"base_path": "data", "metadata_path": "data/metadata.csv"}] * 2
    flat = "prompts:\n" + "".join(f"  - a prompt number {i}\n" for i in range(2_000))
    assert len(parse_yaml(flat, "f", limit=1_000)["prompts"]) == 2_000   # as large as its text: not an expansion
    aliased = flat + "nine: &nine [1, 2, 3, 4, 5, 6, 7, 8, 9]\nmore: [" + ", ".join(["*nine"] * 200) + "]\n"
    with pytest.raises(YamlInputError, match="add more than 1,000 values to the 2,016 written"):
        parse_yaml(aliased, "f", limit=1_000)   # 200 aliases of 10 values: 2,000 more than written
    assert MAX_NODES == 100_000


def test_an_error_on_a_huge_value_stays_short(tmp_path):
    preset = tmp_path / "preset.yaml"
    items = ", ".join(f"[{i}, {i}, {i}]" for i in range(3_000))    # 9,000 values, written out
    preset.write_text(f"dataset_base_path: a\ndataset_metadata_path: b.csv\nlora_target_modules: [{items}]\n"
                      f"run_id: {'x' * 100_000}\n", encoding="utf-8")
    with pytest.raises(OptionsError) as error:
        resolve_options(["--config", str(preset)])
    assert len(str(error.value)) < 500, len(str(error.value))
    listing = tmp_path / "datasets.yaml"
    listing.write_text(f"datasets: {{items: [{items}]}}\n", encoding="utf-8")
    with pytest.raises(OptionsError) as error:
        resolve_options(["--datasets", str(listing), "--output_path", str(tmp_path / "out")])
    assert str(error.value).startswith(f"--datasets {listing} must be a non-empty list") and len(str(error.value)) < 500


def test_quoted_is_repr_for_small_values_and_bounded_for_any():
    assert quoted("abc") == "'abc'" and quoted([1, "x", {"b": 2, "a": None}]) == "[1, 'x', {'b': 2, 'a': None}]"
    long = quoted("y" * 100_000)
    assert long.startswith("'yyy") and long.endswith("... (100,000 characters)") and len(long) < 250
    nested = ["lol"] * 9
    for _ in range(9):
        nested = [nested] * 9
    started = time.monotonic()
    assert len(quoted(nested)) <= 203 and time.monotonic() - started < 0.1
    assert quoted(10 ** 10_000) == "<an integer of 33,220 bits>"
