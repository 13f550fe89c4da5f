"""The file checks of catalogue validation on real folders: symbolic links (loops, broken, leaving the base)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from catalog_helpers import catalog_text
from diffsynth_mbc.data import catalog as cat


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
