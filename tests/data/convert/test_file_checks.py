"""The file checks of catalogue validation on real folders: symbolic links (loops, broken, leaving the base)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from catalog_helpers import catalog_text
from diffsynth_mbc.data.convert import catalogue_rows as cat


def validate(rows, root: Path) -> cat.Validation:
    catalog = cat.parse_catalog_text(catalog_text(rows), name="test.csv")
    return cat.validate_rows(catalog, cat.normalise_base_path(root))


def reasons(validation: cat.Validation) -> dict[int, str]:
    return {r.row: r.reason for r in validation.rejects}


@pytest.mark.parametrize("files_in_folder", [3, 20])   # checked by a stat each, or by one folder listing
def test_a_symlink_loop_rejects_only_its_own_row_with_the_real_reason(tmp_path, files_in_folder):
    folder = tmp_path / "media"
    folder.mkdir()
    names = [f"{i:02d}.mp4" for i in range(files_in_folder)]
    for name in names:
        (folder / name).write_bytes(b"x")
    os.symlink("loop-b.mp4", folder / "loop-a.mp4")
    os.symlink("loop-a.mp4", folder / "loop-b.mp4")
    os.symlink("gone.mp4", folder / "dangling.mp4")
    (folder / "dir.mp4").mkdir()
    rows = [(f"media/{name}", "x", "video") for name in names + ["loop-a.mp4", "dangling.mp4", "dir.mp4", "none.mp4"]]
    result = validate(rows, tmp_path)
    assert [e.row for e in result.accepted] == list(range(1, files_in_folder + 1))
    got = reasons(result)
    n = files_in_folder
    assert got[n + 1] == f"not a readable file ({folder / 'loop-a.mp4'}: Too many levels of symbolic links)"
    assert got[n + 2] == f"missing file ({folder / 'dangling.mp4'}: symbolic link to gone.mp4, which does not exist)"
    assert got[n + 3] == f"not a readable file ({folder / 'dir.mp4'}: a folder)"
    assert got[n + 4] == f"missing file ({folder / 'none.mp4'})"


@pytest.mark.parametrize("files_in_folder", [3, 20])
@pytest.mark.parametrize("base_through_a_link", [False, True])
def test_symlinks_that_leave_the_base_path_are_rejected_by_their_real_path(tmp_path, files_in_folder,
                                                                           base_through_a_link):
    base, elsewhere = tmp_path / "base", tmp_path / "elsewhere"
    (base / "media").mkdir(parents=True)
    elsewhere.mkdir()
    names = [f"{i:02d}.mp4" for i in range(files_in_folder)]
    for folder in (base / "media", elsewhere):
        for name in names:
            (folder / name).write_bytes(b"x")
    os.symlink(elsewhere, base / "linked")                         # a folder inside the base pointing out of it
    os.symlink("/etc/passwd", base / "media" / "passwd.mp4")        # a file pointing out of it
    os.symlink(base / "media" / "00.mp4", base / "media" / "alias.mp4")   # a link that stays inside
    os.symlink("../media", base / "media" / "back")                # a folder link that stays inside
    rows = ([(f"media/{n}", "x", "video") for n in names] + [(f"linked/{n}", "x", "video") for n in names]
            + [("media/passwd.mp4", "x", "video"), ("media/alias.mp4", "x", "video"), ("media/back/01.mp4", "x", "video")])
    if base_through_a_link:                          # the base itself may be a link (a mount point's alias)
        os.symlink(base, tmp_path / "base-alias")
        base = tmp_path / "base-alias"
    result = validate(rows, base)
    n = files_in_folder
    got = reasons(result)
    assert sorted(got) == list(range(n + 1, 2 * n + 4))
    real_base = os.path.realpath(base)
    assert got[n + 1] == (f"path outside --base_path ({base / 'linked' / '00.mp4'} is {elsewhere / '00.mp4'} "
                          f"through a symbolic link, outside {real_base})")
    assert got[2 * n + 1].startswith(f"path outside --base_path ({base / 'media' / 'passwd.mp4'} is /etc/passwd ")
    # The links that stay inside name files of earlier rows: the same files, taken once.
    assert got[2 * n + 2] == "duplicate of an earlier row (row 1: media/alias.mp4 is the same file as media/00.mp4)"
    assert got[2 * n + 3] == "duplicate of an earlier row (row 2: media/back/01.mp4 is the same file as media/01.mp4)"
    assert [e.row for e in result.accepted] == list(range(1, n + 1))
