"""The preflight's ffmpeg check refuses a launch only for runs that call ffmpeg."""

from __future__ import annotations

from diffsynth_mbc.doctor.checks import FAIL, OK, WARN, ffmpeg_check
from diffsynth_mbc.training.options import resolve_options
from e2e_helpers import REPO

DEMO = ["--config", str(REPO / "configs" / "train_demo.yaml")]


def test_a_missing_ffmpeg_fails_only_runs_that_need_it(tmp_path, monkeypatch):
    """imageio-ffmpeg hands back the IMAGEIO_FFMPEG_EXE it is given without looking: a missing one was called found,
    and a missing ffmpeg refused every launch, also those that never call it."""
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(tmp_path / "no-such-ffmpeg"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    plain = ffmpeg_check(resolve_options(DEMO))
    assert plain.status == WARN and "no-such-ffmpeg" in plain.detail and "does not need it" in plain.detail, plain
    sampling = ffmpeg_check(resolve_options([*DEMO, "--sample_prompts", str(prompts)]))
    assert sampling.status == FAIL and "--sample_prompts" in sampling.detail, sampling
    reference = ffmpeg_check(resolve_options([*DEMO, "--decoder", "diffsynth"]))
    assert reference.status == FAIL and "--decoder diffsynth" in reference.detail, reference


def test_a_present_ffmpeg_is_ok(monkeypatch):
    monkeypatch.delenv("IMAGEIO_FFMPEG_EXE", raising=False)
    assert ffmpeg_check(resolve_options(DEMO)).status == OK
