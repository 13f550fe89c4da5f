"""Sample prompt files (YAML or JSON lines) and when samples are due: pure rules."""

from __future__ import annotations

import json

import pytest

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.run_layout import sample_set_name
from diffsynth_mbc.sample_prompts import load_sample_prompts, prompts_file_record, sample_file_stem, sampling_due, slug

SIZE = dict(height=64, width=64, num_frames=9, seed=42)


def test_yaml_and_json_lines_give_the_same_prompts_with_defaults_from_training(tmp_path):
    (tmp_path / "first.png").write_bytes(b"png")
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
    ("- prompt: a\n  height: 70\n", "entry 1: height and width must be positive multiples of 32"),
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
    (tmp_path / "first.png").write_bytes(b"not read here")
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
