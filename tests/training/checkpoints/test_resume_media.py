"""A resume after the media changed, on 2 CPU ranks (gloo), with a catalogue converted with ``--probe`` (width/height
columns): refused once, naming every row that changed, vanished or left, and what to do (the first refusal named only
the cropped clip, as columns that disagree with the file; after converting again, only two metadata hashes). Missing
files that alone would stop the run past ``--max_bad_media_fraction`` refuse it before its first step (a forced
resume trained 36 steps, then failed with TooMuchBadMedia under three tracebacks)."""

from __future__ import annotations

import pytest

from diffsynth_mbc import convert
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.data.demo_data import write_video
from diffsynth_mbc.run_layout import SIZE_TABLE, checkpoint_folder_name
from e2e_helpers import demo_flags, run

pytestmark = pytest.mark.slow


def convert_with_probe(root) -> None:
    assert convert.main([str(root / "catalog" / "catalog.csv"), "--base_path", str(root / "catalog"),
                         "--output", str(root / "metadata"), "--probe"]) == 0


def the_run_as_it_is(run_dir) -> dict:
    """Every byte of the run's status files, histories, checkpoints and LoRA files: a refusal leaves them as they were
    (the size table aside: the sizes read to compare are kept there, as any command keeps them)."""
    return {str(path.relative_to(run_dir)): path.read_bytes() for path in sorted(run_dir.rglob("*"))
            if path.is_file() and path.name != SIZE_TABLE}


FLAGS = {"buckets": "aspect", "num_epochs": 4, "checkpoint_steps": 2, "keep_checkpoints": 100}


def test_a_resume_after_the_media_changed_is_refused_once_naming_every_row(tmp_path):
    root, run_dir = tmp_path / "data", tmp_path / "run"
    prepare(root, num_videos=6, num_images=5)
    convert_with_probe(root)
    code, output = run(tmp_path, demo_flags(root, run_dir, **FLAGS))
    assert code == 0, output[-3000:]
    finished = the_run_as_it_is(run_dir)

    # a clip replaced by a portrait crop, a photo deleted
    media = root / "catalog" / "media"
    write_video(media / "video_001.mp4", 9, 32, 64, seed=5)
    (media / "image_002.png").unlink()
    code, output = run(tmp_path, demo_flags(root, run_dir, resume="latest", **FLAGS))
    assert code != 0
    assert output.count("trained on other media") == 1, output[-3000:]   # said once, by rank 0
    assert ("trained on other media: since it was saved,\n"
            "  1 file changed size: metadata row 2 (media/video_001.mp4): 64x64 then, 32x64 now\n"
            f"  1 file is gone (not found under --dataset_base_path {root / 'catalog'}): metadata row 9 "
            "(media/image_002.png)\n") in output, output[-3000:]
    assert ("start a new run (--start_over true), or pass --force_resume true to go on with this run's settings "
            "and media as they are now, once their width/height columns are the files' sizes again (metadata row 2: "
            "python -m diffsynth_mbc.convert --probe writes them)") in output
    assert "the columns say" not in output and "Traceback" not in output
    assert the_run_as_it_is(run_dir) == finished

    # converted again: the photo's row is gone from the metadata, the clip's columns say its new size
    convert_with_probe(root)
    code, output = run(tmp_path, demo_flags(root, run_dir, resume="latest", **FLAGS))
    assert code != 0
    assert ("trained on other media: since it was saved,\n"
            "  1 file changed size: metadata row 2 (media/video_001.mp4): 64x64 then, 32x64 now\n"
            "  1 row left the metadata: the checkpoint's row 9 (media/image_002.png)\n") in output, output[-3000:]
    assert "metadata_sha256" not in output and "once their width/height columns" not in output
    assert the_run_as_it_is(run_dir) == finished

    # two more photos deleted: a forced resume from step 2 would replace about a fifth of what it still draws
    for name in ("image_003.jpg", "image_004.png"):
        (media / name).unlink()
    code, output = run(tmp_path, demo_flags(root, run_dir, resume=str(run_dir / "lora" / "checkpoints" /
                                                                      checkpoint_folder_name(2)), force_resume="true", **FLAGS))
    assert code != 0
    assert output.count("error: 2 of 10 metadata rows' files are not found (row 9: media/image_003.jpg; row 10: "
                        "media/image_004.png): 6 of each epoch's 30 samples (20.0%), past --max_bad_media_fraction "
                        "0.01") == 1, output[-3000:]
    assert "Nothing was trained or written." in output and "Traceback" not in output
    assert the_run_as_it_is(run_dir) == finished


def test_a_fresh_run_whose_missing_files_alone_would_stop_it_is_refused_before_its_first_step(tmp_path):
    """One missing photo of 28 rows at repeat 3 is 3.6% of every epoch, past the 1% limit."""
    from diffsynth_mbc.training.plan.command import main as plan

    root, run_dir = tmp_path / "data", tmp_path / "run"
    prepare(root, num_videos=6, num_images=22)
    (root / "catalog" / "media" / "image_002.png").unlink()
    flags = demo_flags(root, run_dir, num_epochs=4)
    refusal = ("1 of 28 metadata rows' files are not found (row 9: media/image_002.png): 3 of each epoch's 84 "
               "samples (3.6%), past --max_bad_media_fraction 0.01, so the run would replace about 12 of the 336 "
               "samples it has still to draw and stop part-way")
    code, output = run(tmp_path, flags)
    assert code != 0 and output.count(f"error: {refusal}") == 1, output[-3000:]
    # no status file, history, checkpoint or LoRA file: nothing started (only the run's locks were taken)
    assert {path.name for path in run_dir.rglob("*") if path.is_file()} == {".train.lock"}
    # the launchers' plan says it before any rank starts
    assert plan(["--gpus", "2", "--check-paths", *flags]) == 2
    # a limit above the share: the run may go on (and says what it replaced at the end)
    assert plan(["--gpus", "2", "--check-paths", *flags, "--max_bad_media_fraction", "0.04"]) == 0
