"""Sample clips are written without DiffSynth's "Saving video" tqdm bar, as decodable mp4 files."""

from __future__ import annotations

from types import SimpleNamespace

from PIL import Image

from clip_frames import clip_frames
from diffsynth_mbc.training.evaluation.sample_clips import Sampler


def test_a_sample_clip_is_written_whole_and_draws_no_progress_bar(tmp_path, capfd):
    """DiffSynth's save_video drew "Saving video: 0%|" on the launcher's terminal during sampling."""
    frames = [Image.new("RGB", (64, 32), (20 * i, 100, 200 - 20 * i)) for i in range(5)]
    sampler = Sampler(SimpleNamespace(sample_steps=1, sample_strengths=(1.0,), output_path=str(tmp_path)), status=None,
                      prompts=[])
    files = sampler._write(tmp_path, "00-a-prompt", frames)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == "", captured.err
    assert files == [tmp_path / "00-a-prompt.mp4", tmp_path / "00-a-prompt.png"]
    video = clip_frames(tmp_path / "00-a-prompt.mp4")
    assert video.shape == (5, 32, 64, 3)
    assert sorted(tmp_path.iterdir()) == files   # no temp file left behind
