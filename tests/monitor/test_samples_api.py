"""The samples API and file route over real HTTP: listing, content types, byte ranges, and no way out."""

from __future__ import annotations

import http.client
import os
import time

import pytest

import monitor_fixtures as F
from diffsynth_mbc.monitor.samples import byte_range
from test_server import start_server, stop_server

pytestmark = pytest.mark.slow
VIDEO = bytes(range(256)) * 40   # 10,240 bytes standing in for an mp4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples-api")
    (root / "secret.txt").write_text("top secret")
    output = root / "lora"
    samples = output / "samples"
    for step in (0, 6):
        folder = samples / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "01-a-news-anchor.mp4").write_bytes(VIDEO)
        (folder / "01-a-news-anchor.png").write_bytes(b"\x89PNG-still")
        (folder / ".01-a-news-anchor.mp4.tmp").write_bytes(b"half")     # a temp file is never listed
    os.symlink(root / "secret.txt", samples / "step-00000006" / "02-link.png")  # leads outside: refused
    log_dir = output / "training_logs"
    F.make_run(log_dir, world_size=1, steps=6, now=time.time(), samples_dir=str(samples.resolve()))
    srv = start_server(log_dir)
    yield srv
    stop_server(srv)


def request(srv, path, headers=None):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_the_sets_are_listed_in_step_order_with_their_files(served):
    import json

    status, _, body = request(served, "/api/training/samples")
    assert status == 200
    sets = json.loads(body)["sets"]
    assert [s["step"] for s in sets] == [0, 6]
    # a set written before prompts files existed still lists its clips (the slug stands in for the prompt)
    assert sets[0]["clips"] == [{"index": 1, "slug": "a-news-anchor", "prompt": None, "step": 0, "strength": 1.0,
                                 "weights": "raw", "video": "samples/step-00000000/01-a-news-anchor.mp4",
                                 "still": "samples/step-00000000/01-a-news-anchor.png"}]
    assert json.loads(body)["base"] == []


def test_each_clip_comes_with_its_full_prompt_and_a_korean_name_is_served(tmp_path):
    """The prompts file beside the clips gives the full text, in its own script; the file's URL is percent-encoded
    and decoded again by the file route (a Korean prompt was '01-prompt.mp4' and '1. PROMPT')."""
    import json
    from urllib.parse import quote

    from diffsynth_mbc.atomic import atomic_write_json
    from diffsynth_mbc.sample_prompts import load_sample_prompts, prompts_file_record, sample_file_stem

    long_english = "A news anchor reads the evening headlines while the camera slowly pushes in, warm studio light"
    (tmp_path / "prompts.yaml").write_text(f"- 도시 거리 밤, 비가 내린다\n- {long_english}\n", encoding="utf-8")
    prompts = load_sample_prompts(tmp_path / "prompts.yaml", height=64, width=64, num_frames=9, seed=1)
    samples = tmp_path / "lora" / "samples"
    folder = samples / "step-00000004"
    folder.mkdir(parents=True)
    stems = [sample_file_stem(i, p) for i, p in enumerate(prompts)]
    assert stems[0] == "01-도시-거리-밤-비가-내린다"
    for stem in stems:
        (folder / f"{stem}.mp4").write_bytes(VIDEO)
    atomic_write_json(folder / "prompts.json", prompts_file_record(prompts))
    log_dir = tmp_path / "lora" / "training_logs"
    F.make_run(log_dir, world_size=1, steps=4, now=time.time(), samples_dir=str(samples.resolve()))
    srv = start_server(log_dir)
    try:
        _, _, body = request(srv, "/api/training/samples")
        clips = json.loads(body)["sets"][0]["clips"]
        assert [c["prompt"] for c in clips] == ["도시 거리 밤, 비가 내린다", long_english]
        assert clips[0]["video"] == "samples/step-00000004/" + quote("01-도시-거리-밤-비가-내린다.mp4")
        status, headers, served_body = request(srv, "/" + clips[0]["video"])
        assert status == 200 and served_body == VIDEO and headers["Content-Type"] == "video/mp4"
        assert request(srv, "/samples/step-00000004/01-%ED%95%9C%FF.mp4")[0] == 404   # not UTF-8: refused, no 500
    finally:
        stop_server(srv)


def test_every_clip_says_its_strength_and_weights_and_the_base_models_clips_are_listed_apart(tmp_path):
    """--sample_strengths 0,0.5,1 with --validate_with both: the EMA's clips (once listed nowhere) beside the raw
    ones, each strength's, and the base model's, rendered once; a prompt ending in "ema" is not an EMA clip."""
    import json
    from urllib.parse import quote

    from diffsynth_mbc.atomic import atomic_write_json
    from diffsynth_mbc.sample_prompts import clip_suffix, load_sample_prompts, prompts_file_record, sample_file_stem

    (tmp_path / "prompts.yaml").write_text("- 도시 거리 밤\n- a dance called the ema\n", encoding="utf-8")
    prompts = load_sample_prompts(tmp_path / "prompts.yaml", height=64, width=64, num_frames=9, seed=1)
    samples = tmp_path / "lora" / "samples"
    folder, base = samples / "step-00000004", samples / "base"
    folder.mkdir(parents=True)
    base.mkdir()
    for index, prompt in enumerate(prompts):
        stem = sample_file_stem(index, prompt)
        for strength, weights in ((0.5, "raw"), (1.0, "raw"), (0.5, "ema"), (1.0, "ema")):
            (folder / f"{stem}{clip_suffix(strength, weights)}.mp4").write_bytes(VIDEO)
        (base / f"{stem}-base.mp4").write_bytes(VIDEO)
        (base / f"{stem}-base.png").write_bytes(b"\x89PNG")
    atomic_write_json(folder / "prompts.json", prompts_file_record(prompts))
    atomic_write_json(base / "prompts.json", {"prompts": [{**entry, "step": 0}
                                                          for entry in prompts_file_record(prompts)["prompts"]]})
    log_dir = tmp_path / "lora" / "training_logs"
    F.make_run(log_dir, world_size=1, steps=4, now=time.time(), samples_dir=str(samples.resolve()))
    srv = start_server(log_dir)
    try:
        _, _, body = request(srv, "/api/training/samples")
        listing = json.loads(body)
        clips = listing["sets"][0]["clips"]
        assert [(c["index"], c["step"], c["strength"], c["weights"]) for c in clips] == [
            (1, 4, 0.5, "raw"), (1, 4, 0.5, "ema"), (1, 4, 1.0, "raw"), (1, 4, 1.0, "ema"),
            (2, 4, 0.5, "raw"), (2, 4, 0.5, "ema"), (2, 4, 1.0, "raw"), (2, 4, 1.0, "ema")]
        assert {c["slug"] for c in clips[4:]} == {"a-dance-called-the-ema"}
        assert clips[7]["video"] == "samples/step-00000004/02-a-dance-called-the-ema-ema.mp4"
        assert clips[1]["video"] == "samples/step-00000004/" + quote("01-도시-거리-밤-s0.5-ema.mp4")
        assert listing["base"] == [
            {"index": 1, "slug": "도시-거리-밤", "prompt": "도시 거리 밤", "step": 0, "strength": 0.0, "weights": None,
             "video": "samples/base/" + quote("01-도시-거리-밤-base.mp4"),
             "still": "samples/base/" + quote("01-도시-거리-밤-base.png")},
            {"index": 2, "slug": "a-dance-called-the-ema", "prompt": "a dance called the ema", "step": 0,
             "strength": 0.0, "weights": None, "video": "samples/base/02-a-dance-called-the-ema-base.mp4",
             "still": "samples/base/02-a-dance-called-the-ema-base.png"}]
        for clip in clips + listing["base"]:
            status, headers, served_body = request(srv, "/" + clip["video"])
            assert status == 200 and served_body == VIDEO and headers["Content-Type"] == "video/mp4"
        assert request(srv, "/samples/base/../step-00000004/prompts.json")[0] == 404
        assert request(srv, "/samples/basement/01-x-base.mp4")[0] == 404
    finally:
        stop_server(srv)


def test_files_come_with_their_type_and_byte_ranges(served):
    status, headers, body = request(served, "/samples/step-00000006/01-a-news-anchor.mp4")
    assert status == 200 and body == VIDEO and headers["Content-Type"] == "video/mp4"
    assert headers["Accept-Ranges"] == "bytes"
    status, headers, body = request(served, "/samples/step-00000006/01-a-news-anchor.mp4", {"Range": "bytes=100-199"})
    assert status == 206 and body == VIDEO[100:200] and headers["Content-Range"] == f"bytes 100-199/{len(VIDEO)}"
    status, headers, body = request(served, "/samples/step-00000006/01-a-news-anchor.mp4", {"Range": "bytes=-10"})
    assert status == 206 and body == VIDEO[-10:]
    status, headers, _ = request(served, "/samples/step-00000006/01-a-news-anchor.mp4", {"Range": "bytes=99999-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(VIDEO)}"
    status, headers, body = request(served, "/samples/step-00000000/01-a-news-anchor.png")
    assert status == 200 and headers["Content-Type"] == "image/png" and body == b"\x89PNG-still"


@pytest.mark.parametrize("path", [
    "/samples/../secret.txt", "/samples/step-00000006/../../secret.txt", "/samples/%2e%2e/secret.txt",
    "/samples/step-00000006/%2e%2e%2f%2e%2e%2fsecret.txt", "/samples//etc/passwd", "/samples/step-00000006/02-link.png",
    "/samples/step-00000000/.01-a-news-anchor.mp4.tmp", "/samples/step-00000000", "/samples/" + "/".join(["x"] * 5),
    "/samples/step-00000000/01-a-news-anchor.mp4/..", "/samples/training_logs/training_gpu0.json",
])
def test_nothing_outside_the_samples_folder_is_served(served, path):
    status, _, body = request(served, path)
    assert status == 404 and b"top secret" not in body


def test_byte_range_rules():
    assert byte_range(None, 100) is None
    assert byte_range("bytes=0-0", 100) == (0, 0) and byte_range("bytes=90-200", 100) == (90, 99)
    assert byte_range("bytes=-300", 100) == (0, 99) and byte_range("Bytes = 5-", 100) == (5, 99)
    for past_the_end in ("bytes=100-", "bytes=-0", "bytes=100-200", "bytes=" + "9" * 5000 + "-"):
        assert byte_range(past_the_end, 100) == "unsatisfiable", past_the_end[:20]
    assert byte_range("bytes=0-", 0) == "unsatisfiable"
    assert byte_range("bytes=0-" + "9" * 5000, 100) == (0, 99) and byte_range("bytes=-" + "9" * 5000, 100) == (0, 99)
    # RFC 9110: a header that is not one byte range is ignored (the whole file), not refused
    for ignored in ("bytes=5-1", "bytes=-", "items=0-1", "bytes=0-1,5-9", "bytes=0-1, 3-4", "bytes=a-b", "bytes 0-1",
                    "bytes=" + "9" * 5000 + "-1"):
        assert byte_range(ignored, 100) is None, ignored[:20]


@pytest.mark.parametrize("header", ["bytes=0-" + "9" * 5000, "items=0-99", "bytes=200-100", "bytes=0-1,4-8",
                                    "bytes=-", "bytes=x-y"])
def test_range_headers_that_are_not_one_byte_range_get_the_whole_file(served, header):
    # a 5,000-digit position was a 500 (int()'s digit limit); an unknown unit, a reversed range and several
    # ranges were 416, where RFC 9110 says to ignore the header
    status, headers, body = request(served, "/samples/step-00000006/01-a-news-anchor.mp4", {"Range": header})
    if header.startswith("bytes=0-9"):
        assert status == 206 and body == VIDEO and headers["Content-Range"] == f"bytes 0-{len(VIDEO) - 1}/{len(VIDEO)}"
    else:
        assert status == 200 and body == VIDEO and "Content-Range" not in headers, header
    status, headers, body = request(served, "/samples/step-00000006/01-a-news-anchor.mp4",
                                    {"Range": "bytes=" + "9" * 5000 + "-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(VIDEO)}" and body == b""


def test_a_status_file_cannot_point_the_route_at_another_folder():
    from diffsynth_mbc.monitor.samples import samples_root

    for hostile in ("/", "/etc", "relative/samples", "", 42):
        assert samples_root({"ranks": [{"rank": 0, "samples_dir": hostile}]}) is None
    assert str(samples_root({"ranks": [{"rank": 1, "samples_dir": "/runs/x/samples"}]})) == "/runs/x/samples"
