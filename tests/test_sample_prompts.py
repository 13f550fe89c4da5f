"""Sample prompt files (YAML or JSON lines) and when samples are due: pure rules."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.run_layout import sample_set_name
from diffsynth_mbc.sample_prompts import load_sample_prompts, prompts_file_record, sample_file_stem, sampling_due, slug

SIZE = dict(height=64, width=64, num_frames=9, seed=42)


def a_picture(path):
    Image.new("RGB", (48, 32), (200, 40, 40)).save(path)
    return path


def test_yaml_and_json_lines_give_the_same_prompts_with_defaults_from_training(tmp_path):
    a_picture(tmp_path / "first.png")
    (tmp_path / "p.yaml").write_text("- prompt: a news anchor speaks\n  image: first.png\n  steps: 4\n"
                                     "- prompt: 비 오는 거리\n  seed: 7\n  width: 96\n  cfg_scale: 1\n")
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(e) for e in (
        {"prompt": "a news anchor speaks", "image": "first.png", "steps": 4},
        {"prompt": "비 오는 거리", "seed": 7, "width": 96, "cfg_scale": 1})) + "\n")
    from_yaml = load_sample_prompts(tmp_path / "p.yaml", **SIZE)
    assert from_yaml == load_sample_prompts(tmp_path / "p.jsonl", **SIZE)
    first, second = from_yaml
    assert (first.seed, first.height, first.width, first.num_frames, first.steps) == (42, 64, 64, 9, 4)
    assert first.image == str(tmp_path / "first.png")
    assert (second.seed, second.width, second.cfg_scale, second.image) == (7, 96, 1.0, None)


@pytest.mark.parametrize("text, message", [
    ("- prompt: ''\n", "entry 1: needs a non-empty 'prompt'"),
    ("- prompt: a\n- {prompt: b, colour: red}\n", "entry 2: unknown key(s) colour"),
    ("- prompt: a\n  height: 70\n", "entry 1: height and width must be multiples of 32"),
    ("- prompt: a\n  num_frames: 8\n", "entry 1: num_frames must be 4k+1"),
    ("- prompt: a\n  image: missing.png\n", "entry 1: image not found"),
    ("- prompt: a\n  steps: many\n", "entry 1:"),
    ("prompt: a\n", "expected a list of prompts"),
    ("[]\n", "no prompts"),
])
def test_bad_entries_are_refused_naming_the_file_and_entry(tmp_path, text, message):
    path = tmp_path / "prompts.yaml"
    path.write_text(text)
    with pytest.raises(OptionsError) as caught:
        load_sample_prompts(path, **SIZE)
    assert message in str(caught.value) and str(path) in str(caught.value)


@pytest.mark.parametrize("entry, message", [
    ("cfg_scale: .nan", "cfg_scale must be a finite number from 0 to 100 (1: no guidance), got nan"),
    ("cfg_scale: -.inf", "cfg_scale must be a finite number"),
    ("cfg_scale: 101", "cfg_scale must be a finite number from 0 to 100"),
    ("cfg_scale: [1, 2]", "cfg_scale must be a finite number"),
    ("num_frames: 100001", "num_frames must be a whole number from 1 to 257, got 100001"),
    ("height: 32000", "height must be a whole number from 32 to 4,096, got 32000"),
    ("width: 32000", "width must be a whole number from 32 to 4,096, got 32000"),
    ("seed: 100000000000000000000000", "seed must be a whole number from 0 to 18,446,744,073,709,551,615"),
    ("seed: -1", "seed must be a whole number from 0"),
    ("seed: 1.5", "seed must be a whole number"),
    ("seed: true", "seed must be a whole number"),
    ("seed: 1.0e+30", "seed must be a whole number"),
    ("steps: 0", "steps must be a whole number from 1 to 1,000"),
    ("steps: 100000", "steps must be a whole number from 1 to 1,000"),
    ("steps: .nan", "steps must be a whole number"),
    ("negative_prompt: [blurry]", "negative_prompt must be text"),
    ("image: 7", "image must be a file name"),
])
def test_every_field_is_checked_finite_and_in_range_naming_the_file_entry_and_field(tmp_path, entry, message):
    path = tmp_path / "prompts.yaml"
    path.write_text(f"- a first prompt\n- prompt: a second\n  {entry}\n")
    with pytest.raises(OptionsError) as caught:
        load_sample_prompts(path, **SIZE)
    assert f"--sample_prompts {path}: entry 2: {message}" in str(caught.value)


def test_a_default_out_of_range_is_refused_too_and_in_range_values_load(tmp_path):
    path = tmp_path / "prompts.yaml"
    path.write_text("- prompt: a\n  seed: 18446744073709551615\n  cfg_scale: 0\n  num_frames: 257\n"
                    "  steps: 1000\n  height: 4096\n- prompt: b\n  seed: '7'\n  steps: 2.0\n")
    first, second = load_sample_prompts(path, **SIZE)
    assert (first.seed, first.cfg_scale, first.num_frames, first.steps) == (2**64 - 1, 0.0, 257, 1000)
    assert (second.seed, second.steps) == (7, 2) and isinstance(second.steps, int)
    with pytest.raises(OptionsError, match="entry 2: num_frames must be a whole number from 1 to 257, got 1001"):
        load_sample_prompts(path, **{**SIZE, "num_frames": 1001})   # the run's own --num_frames, as the default


def test_an_image_that_is_a_folder_a_fifo_or_no_picture_is_named_as_such(tmp_path):
    (tmp_path / "folder.png").mkdir()
    os.mkfifo(tmp_path / "fifo.png")   # reading it would wait for ever
    (tmp_path / "text.png").write_text("not a picture")
    for name, said in (("folder.png", "is a folder, not a picture file"),
                       ("fifo.png", "is not a regular file, not a picture file"),
                       ("text.png", "cannot be read as a picture"), ("gone.png", "image not found")):
        path = tmp_path / "prompts.yaml"
        path.write_text(f"- prompt: a\n  image: {name}\n")
        with pytest.raises(OptionsError) as caught:
            load_sample_prompts(path, **SIZE)
        assert f"--sample_prompts {path}: entry 1: " in str(caught.value) and said in str(caught.value), name


def test_a_prompts_file_that_is_not_utf8_or_not_a_file_is_named(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("- prompt: un caf\u00e9\n".encode("latin-1"))
    with pytest.raises(OptionsError, match=f"--sample_prompts {latin}: not UTF-8 text \\(byte 0xe9 at position 16\\); "
                                           "save it as UTF-8"):
        load_sample_prompts(latin, **SIZE)
    (tmp_path / "folder.yaml").mkdir()
    with pytest.raises(OptionsError, match="folder.yaml: a folder, not a prompts file"):
        load_sample_prompts(tmp_path / "folder.yaml", **SIZE)
    os.mkfifo(tmp_path / "fifo.yaml")
    with pytest.raises(OptionsError, match="fifo.yaml: not a regular file, not a prompts file"):
        load_sample_prompts(tmp_path / "fifo.yaml", **SIZE)
    with pytest.raises(OptionsError, match=f"^prompts file {latin}: not UTF-8"):   # the sweep names its argument
        load_sample_prompts(latin, **SIZE, source="prompts file")


def test_the_training_refuses_a_bad_prompt_before_it_loads_the_model(tmp_path, monkeypatch, capsys):
    from diffsynth_mbc.data.demo import prepare
    from diffsynth_mbc.training.cli import main
    from e2e_helpers import demo_flags

    monkeypatch.chdir(tmp_path)
    prepare(tmp_path / "demo", num_videos=1, num_images=1)
    (tmp_path / "prompts.yaml").write_text("- prompt: a\n  steps: 2\n- prompt: b\n  cfg_scale: .nan\n")
    flags = demo_flags(tmp_path / "demo", tmp_path / "run", sample_prompts=tmp_path / "prompts.yaml",
                       run_id="bad-prompts")
    assert main(flags) == 2
    assert f"--sample_prompts {tmp_path / 'prompts.yaml'}: entry 2: cfg_scale must be a finite number" in \
        capsys.readouterr().err
    assert not list((tmp_path / "run" / "logs").glob("training_gpu*"))   # no status: nothing started, no model


def test_names_and_schedule():
    assert slug("Ein Nachrichtensprecher spricht, die Kamera zoomt langsam heran!") == \
        "ein-nachrichtensprecher-spricht-die-kame"
    assert slug("비 오는 거리") == "비-오는-거리"   # in its own script, not "prompt"
    assert slug("Großer Bahnhof: Zürich") == "großer-bahnhof-zürich"
    assert slug("!!! ...") == "prompt"
    assert sample_set_name(120) == "step-00000120"
    assert [s for s in range(0, 13) if sampling_due(s, 5, 12)] == [0, 5, 10, 12]
    assert [s for s in range(0, 13) if sampling_due(s, 5, 12, first_step=6)] == [5, 10, 12]   # resumed: no baseline
    assert [s for s in range(0, 13) if sampling_due(s, None, 12)] == [0, 12]


def test_file_stems_number_the_prompts(tmp_path):
    (tmp_path / "p.yaml").write_text("- a b\n- c\n")
    prompts = load_sample_prompts(tmp_path / "p.yaml", **SIZE)
    assert [sample_file_stem(i, p) for i, p in enumerate(prompts)] == ["01-a-b", "02-c"]


def test_the_prompts_file_keeps_every_prompt_whole(tmp_path):
    long_english = "A News Anchor reads the evening headlines while the camera slowly pushes in, warm studio light"
    (tmp_path / "p.yaml").write_text(f"- 도시 거리 밤\n- {long_english}\n", encoding="utf-8")
    prompts = load_sample_prompts(tmp_path / "p.yaml", **SIZE)
    record = prompts_file_record(prompts)
    assert [(e["index"], e["stem"], e["prompt"]) for e in record["prompts"]] == [
        (1, "01-도시-거리-밤", "도시 거리 밤"),
        (2, "02-a-news-anchor-reads-the-evening-headline", long_english)]   # the name is short, the text whole
    assert record["prompts"][1]["seed"] == 43 and json.loads(json.dumps(record)) == record


def test_the_prompts_file_says_which_clips_render_from_an_image(tmp_path):
    a_picture(tmp_path / "first.png")
    (tmp_path / "p.yaml").write_text("- prompt: a street\n  image: first.png\n- a field\n")
    record = prompts_file_record(load_sample_prompts(tmp_path / "p.yaml", **SIZE))
    assert [entry["mode"] for entry in record["prompts"]] == ["i2v", "t2v"]


def test_sample_strengths_are_read_once_each_in_order_and_bad_ones_refused():
    from diffsynth_mbc.sample_prompts import parse_strengths

    assert parse_strengths("1") == [1.0] and parse_strengths(1) == [1.0]   # the default: today's clips
    assert parse_strengths(" 1, 0 ,0.5") == [0.0, 0.5, 1.0] and parse_strengths("-0,-0.25,1.5") == [-0.25, 0.0, 1.5]
    for bad in ("", "0,,1", "a", "nan", "inf", "11", "0.0001", "[0, 1]", "1e400"):
        with pytest.raises(OptionsError, match="--sample_strengths must be comma-separated numbers"):
            parse_strengths(bad)
    with pytest.raises(OptionsError, match="names 0.5 twice"):
        parse_strengths("0.5,1,0.50")
    with pytest.raises(OptionsError, match="^--strengths must be comma-separated numbers"):   # the sweep's flag
        parse_strengths("nan", flag="--strengths")


def test_each_strength_and_weights_names_its_clip_and_the_name_reads_back():
    """Strength 1 keeps the names clips always had; the base model is one name whatever the weights."""
    from diffsynth_mbc.sample_prompts import clip_suffix, read_clip_suffix

    cases = {(1.0, "raw"): "", (1.0, "ema"): "-ema", (0.5, "raw"): "-s0.5", (0.5, "ema"): "-s0.5-ema",
             (1.25, "raw"): "-s1.25", (-0.5, "raw"): "-s-0.5", (10.0, "ema"): "-s10-ema", (0.0, None): "-base"}
    for (strength, weights), suffix in cases.items():
        assert clip_suffix(strength, weights) == suffix
        assert read_clip_suffix(suffix) == (strength, weights)
    assert clip_suffix(0.0, "ema") == "-base"
    for other in ("-s1", "-s0", "-sx", "-s0.5-raw", "-base-ema", "-s0.50001", "-ema-s0.5", "-s100"):
        assert read_clip_suffix(other) is None, other
