"""What a resume names of the rows and media since its checkpoint (pure): every row whose file changed size,
vanished or came back, every row that left the metadata or is new in it, once. The first refusal after a clip was
cropped and a photo deleted named only the clip; after converting again, only the metadata's two sha256 hashes."""

from pathlib import Path

from diffsynth_mbc.training.checkpoints.row_sizes import MediaNow, media_changes, resume_refusal

SAVED = [["media/clip.mp4", 64, 64], ["media/wide.mp4", 128, 72], ["media/photo.png", 64, 64],
         ["media/old.png", 32, 32], ["media/twice.png", 10, 10], ["media/twice.png", 10, 10]]


def now(videos, sizes=None, missing=(), stale=()):
    return MediaNow(list(videos), sizes, list(missing), list(stale), "catalog")


def test_every_row_that_changed_vanished_came_back_left_or_is_new_is_named():
    current = now(["media/clip.mp4", "media/wide.mp4", "media/photo.png", "media/twice.png", "media/new.mp4"],
                  sizes=[(32, 64), (128, 72), (64, 64), (10, 10), (96, 96)], missing=[3])
    assert media_changes(SAVED, [4], current, sizes_kept=True) == [
        "1 file changed size: metadata row 1 (media/clip.mp4): 64x64 then, 32x64 now",
        "1 file is gone (not found under --dataset_base_path catalog): metadata row 3 (media/photo.png)",
        "2 rows left the metadata: the checkpoint's row 4 (media/old.png); the checkpoint's row 6 (media/twice.png)",
        "1 row is new in the metadata: metadata row 5 (media/new.mp4)"]
    # a file missing then and there now came back; whether a file was there is unknown for older checkpoints
    back = now([video for video, *_ in SAVED], sizes=[tuple(size) for _, *size in SAVED])
    assert media_changes(SAVED, [4], back, sizes_kept=True) == [
        "1 file is back (it was not found when the checkpoint's run started): metadata row 4 (media/old.png)"]
    assert media_changes(SAVED, None, back, sizes_kept=True) == []
    # under --buckets off no size is compared
    assert media_changes(SAVED, [], now([video for video, *_ in SAVED]), sizes_kept=False) == []


def test_a_long_list_names_the_first_rows_and_counts_the_rest():
    saved = [[f"media/{index}.mp4", 64, 64] for index in range(1, 9)]
    current = now([video for video, *_ in saved], sizes=[(32, 64)] * 8)
    (line,) = media_changes(saved, [], current, sizes_kept=True)
    assert line.startswith("8 files changed size: metadata row 1 (media/1.mp4): 64x64 then, 32x64 now; ")
    assert line.endswith("metadata row 5 (media/5.mp4): 64x64 then, 32x64 now; and 3 more")


def test_one_refusal_says_the_rows_the_settings_and_what_to_do():
    folder = Path("checkpoints/step-00000024")
    changes = ["1 file changed size: metadata row 2 (media/clip.mp4): 64x64 then, 32x64 now"]
    refusal = resume_refusal(folder, ["metadata_sha256: checkpoint 'aaa', this run 'bbb'", "lora_rank: checkpoint 4, "
                                      "this run 8"], changes, now(["media/clip.mp4"], stale=[2]), "2 of 10 ...")
    assert refusal.splitlines()[:4] == [
        f"checkpoint {folder} trained on other media: since it was saved,", f"  {changes[0]}",
        "and it was made with a different configuration:", "  lora_rank: checkpoint 4, this run 8"]
    assert "aaa" not in refusal and "start a new run (--start_over true)" in refusal
    assert "pass --force_resume true" in refusal and "metadata row 2: python -m diffsynth_mbc.convert --probe" in refusal
    assert refusal.endswith("that is refused too while 2 of 10 ...")
    # the metadata changed, but no row's file or size did: said so, never as two hashes
    only_cells = resume_refusal(folder, ["metadata_sha256: checkpoint 'aaa', this run 'bbb'"], [], None)
    assert "their captions or other columns did" in only_cells and "aaa" not in only_cells
    # settings alone: as before
    assert resume_refusal(folder, ["lora_rank: checkpoint 4, this run 8"], [], None).startswith(
        f"checkpoint {folder} was made with a different configuration:")
    assert resume_refusal(folder, [], [], None) is None
