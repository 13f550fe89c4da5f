"""Parsing, validation, selection and accounting of MBC catalogues (no media decoding)."""

from __future__ import annotations

import io
import os
import string
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from catalog_helpers import catalog_text
from diffsynth_mbc.data.convert import catalogue_rows as cat
from diffsynth_mbc.data.convert import file_checks
from diffsynth_mbc.data.convert import selection
from diffsynth_mbc.data.convert.outputs import metadata_text

MESSY = (
    "\ufeff file_path , Caption ,MEDIA_TYPE ,source\r\n"
    "\r\n"
    'media/a.mp4,"안녕하세요, ""MBC"" 뉴스\r\n두 번째 줄",Video,cam1\r\n'
    ",,,\r\n"
    "media/b.png,plain caption,IMAGE,cam2\r\n"
    "   \r\n"
)


def parse(text: str) -> cat.Catalog:
    return cat.parse_catalog_text(text.removeprefix("\ufeff"), name="test.csv")


def make_files(root: Path, names) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"")


def validate(rows, root: Path, check_files=True, header=("file_path", "caption", "media_type"), **kwargs):
    catalog = parse(catalog_text(rows, header))
    return catalog, cat.validate_rows(catalog, cat.normalise_base_path(root), check_files=check_files, **kwargs)


def reasons(validation: cat.Validation) -> dict[int, str]:
    return {r.row: r.reason for r in validation.rejects}


# --- parsing -----------------------------------------------------------------------------------


def test_messy_catalog_parses_rows_lines_and_blank_lines():
    catalog = parse(MESSY)
    assert catalog.columns == ["file_path", "Caption", "MEDIA_TYPE", "source"]
    assert [r.row for r in catalog.rows] == [1, 2]
    assert [r.line for r in catalog.rows] == [3, 6]  # the caption of row 1 spans lines 3-4; ",,," is line 5
    assert catalog.rows[0].caption == '안녕하세요, "MBC" 뉴스\r\n두 번째 줄'
    assert catalog.rows[0].media_type == "Video"
    assert catalog.rows[1].file_path == "media/b.png"
    assert catalog.blank_lines == 3


def test_read_catalog_strips_bom_and_hashes_the_bytes(tmp_path):
    path = tmp_path / "c.csv"
    path.write_bytes(MESSY.encode("utf-8"))
    catalog = cat.read_catalog(path)
    assert catalog.columns[0] == "file_path"
    import hashlib
    assert catalog.sha256 == hashlib.sha256(MESSY.encode("utf-8")).hexdigest()


def test_blank_lines_before_the_header_are_skipped():
    catalog = parse("\n\nfile_path,caption,media_type\na.mp4,x,video\n")
    assert len(catalog.rows) == 1 and catalog.rows[0].line == 4


@pytest.mark.parametrize("text, message", [
    ("file_path,caption\na.mp4,x\n", "missing required column 'media_type'"),
    ("path,caption,media_type\n", "missing required column 'file_path'"),
    ("file_path,caption,caption,media_type\n", "'caption' appears 2 times"),
    ("", "empty file"),
    ("\n\n", "empty file"),
    ('file_path,caption,media_type\na.mp4,x,video\nb.mp4,"never closed,video\n', "malformed CSV at line 3"),
    ('file_path,caption,media_type\na.mp4,"x"y,video\n', "malformed CSV at line 2"),
])
def test_malformed_catalogs_raise_with_the_problem(text, message):
    with pytest.raises(cat.CatalogError, match=message):
        parse(text)


def test_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "euc.csv"
    path.write_bytes("file_path,caption,media_type\na.mp4,".encode() + "한국어".encode("euc-kr") + b",video\n")
    with pytest.raises(cat.CatalogError, match=r"euc\.csv: not UTF-8 \(line 2"):
        cat.read_catalog(path)


def test_missing_catalog_file(tmp_path):
    with pytest.raises(cat.CatalogError, match="file not found"):
        cat.read_catalog(tmp_path / "nope.csv")


def test_pandas_na_strings_match_installed_pandas():
    from pandas._libs.parsers import STR_NA_VALUES

    assert cat.PANDAS_NA_STRINGS == set(STR_NA_VALUES)


# --- validation -------------------------------------------------------------------------------


def test_every_reject_reason(tmp_path):
    root = tmp_path / "data"
    make_files(root, ["v/ok.mp4", "v/dup.mp4", "i/ok.JPG", "v/word.png", "v/x.txt", "i/pic.png"])
    outside = tmp_path / "elsewhere.mp4"
    outside.write_bytes(b"")
    rows = [
        ("v/ok.mp4", "fine, with a comma", "video"),  # 1 accepted
        ("v/ok.mp4", "again", "VIDEO"),  # 2 duplicate of row 1
        ("v/./sub/../ok.mp4", "same file by another spelling", "video"),  # 3 duplicate of row 1
        ("../elsewhere.mp4", "traversal", "video"),  # 4 outside
        (str(outside), "absolute elsewhere", "video"),  # 5 outside
        ("", "no path", "video"),  # 6 empty path
        ("v/dup.mp4", "x", "audio"),  # 7 unknown media type
        ("v/x.txt", "x", "video"),  # 8 unsupported extension
        ("v/word.png", "x", "video"),  # 9 contradicts
        ("v/dup.mp4", "  \n ", "video"),  # 10 empty caption
        ("v/dup.mp4", "NA", "video"),  # 11 caption reads as NaN
        ("v/dup.mp4", "2024", "video"),  # 12 caption reads as a number
        ("v/missing.mp4", "x", "video"),  # 13 missing file
        ("i/ok.JPG", " Image ", " image "),  # 14 accepted (case-blind extension and type)
        (str(root / "i/pic.png"), "absolute inside base", "image"),  # 15 accepted, written relative
        ("v/dup.mp4", "the earlier rejects of this path do not make it a duplicate", "video"),  # 16 accepted
    ]
    _, result = validate(rows, root)
    got = reasons(result)
    assert got[2] == "duplicate of an earlier row (row 1)"
    assert got[3] == "duplicate of an earlier row (row 1)"
    assert got[4].startswith("path outside --base_path")
    assert got[5].startswith("path outside --base_path")
    assert got[6] == "empty file_path"
    assert got[7] == "unknown media_type ('audio')"
    assert got[8] == "unsupported extension ('.txt')"
    assert got[9] == "extension contradicts media_type ('.png' is image, row says video)"
    assert got[10] == "empty caption"
    assert got[11] == "caption does not read back as text in pandas ('NA' reads as NaN)"
    assert got[12] == "caption does not read back as text in pandas ('2024' reads as a number)"
    assert got[13].startswith("missing file")
    assert sorted(got) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    accepted = {e.row: e for e in result.accepted}
    assert sorted(accepted) == [1, 14, 15, 16]
    assert accepted[14].media_type == "image" and accepted[14].relative_path == "i/ok.JPG"
    assert accepted[15].relative_path == "i/pic.png"
    assert accepted[1].source.caption == "fine, with a comma"


def test_malformed_row_field_count(tmp_path):
    make_files(tmp_path, ["a.mp4"])
    text = "file_path,caption,media_type\na.mp4,안녕, 세계,video\nb.mp4,short\n"
    catalog = parse(text)
    result = cat.validate_rows(catalog, cat.normalise_base_path(tmp_path))
    assert reasons(result) == {1: "malformed row (4 fields, header has 3)", 2: "malformed row (2 fields, header has 3)"}


def test_no_check_files_accepts_missing_files(tmp_path):
    _, result = validate([("gone.mp4", "x", "video")], tmp_path, check_files=False)
    assert [e.row for e in result.accepted] == [1]
    _, result = validate([("gone.mp4", "x", "video")], tmp_path, check_files=True)
    assert reasons(result) == {1: f"missing file ({tmp_path / 'gone.mp4'})"}


def test_existence_check_by_folder_listing_matches_stat(tmp_path):
    names = [f"many/{i:03d}.mp4" for i in range(40)]
    make_files(tmp_path, names[::2])
    (tmp_path / "many" / "dir.mp4").mkdir()
    wanted = [os.path.join(str(tmp_path), n) for n in names + ["many/dir.mp4", "nofolder/a.mp4"]]
    problems = file_checks.file_problems(wanted)
    assert {p for p in wanted if p not in problems} == {p for p in wanted if os.path.isfile(p)}
    assert len(problems) == 22


def test_validation_rows_win_over_training_duplicates(tmp_path):
    make_files(tmp_path, ["a.mp4", "b.mp4"])
    _, result = validate([("a.mp4", "x", "video"), ("b.mp4", "y", "video")], tmp_path,
                         validation_paths={str(tmp_path / "a.mp4"): 7})
    assert reasons(result) == {1: "duplicate of validation row (validation row 7)"}


def test_extensions_are_case_blind_and_need_a_dot():
    assert cat.file_extension("/x/y/CLIP.MP4") == "mp4"
    assert cat.file_extension("/x/y.dir/noext") == ""
    assert cat.file_extension("/x/.mp4") == ""


# --- selection ---------------------------------------------------------------------------------


def entries(videos: int, images: int) -> list[cat.Entry]:
    result = []
    for index in range(videos + images):
        media_type = "video" if index < videos else "image"
        row = cat.CatalogRow(index + 1, index + 2, f"f{index}", "c", media_type, 3)
        result.append(cat.Entry("train", row, media_type, f"/b/f{index}", f"f{index}"))
    return result


def test_stratified_counts_sum_and_ratio():
    assert selection.stratified_counts({"video": 80_000, "image": 90_180}, 5000) == {"video": 2350, "image": 2650}
    assert sum(selection.stratified_counts({"video": 3, "image": 4}, 5).values()) == 5
    assert selection.stratified_counts({"video": 3, "image": 4}, 100) == {"video": 3, "image": 4}


def test_subset_is_stratified_deterministic_and_seeded():
    pool = entries(470, 530)
    picked, rest = selection.stratified_subset(pool, 100, seed=1)
    assert selection.count_media_types(picked) == {"video": 47, "image": 53}
    assert len(rest) == 900 and not {e.row for e in picked} & {e.row for e in rest}
    again, _ = selection.stratified_subset(pool, 100, seed=1)
    other, _ = selection.stratified_subset(pool, 100, seed=2)
    assert [e.row for e in again] == [e.row for e in picked]
    assert [e.row for e in other] != [e.row for e in picked]
    assert [e.row for e in picked] == sorted(e.row for e in picked)  # catalogue order kept


def test_subset_larger_than_pool_takes_all():
    pool = entries(2, 3)
    picked, rest = selection.stratified_subset(pool, 10, seed=0)
    assert len(picked) == 5 and rest == []


def test_split_is_stratified_disjoint_and_deterministic():
    pool = entries(40, 60)
    train, val = selection.stratified_split(pool, 0.1, seed=3)
    assert selection.count_media_types(val) == {"video": 4, "image": 6}
    assert len(train) + len(val) == 100 and not {e.row for e in train} & {e.row for e in val}
    assert [e.row for e in selection.stratified_split(pool, 0.1, seed=3)[1]] == [e.row for e in val]


def test_plan_accounts_for_every_row(tmp_path):
    names = [f"v{i}.mp4" for i in range(6)] + [f"i{i}.png" for i in range(6)]
    make_files(tmp_path, names)
    train_rows = [(n, f"caption {n}", "video" if n.endswith("mp4") else "image") for n in names]
    train_rows.append(("missing.mp4", "x", "video"))
    val_rows = [("v0.mp4", "also in train", "video"), ("i5.png", "val image", "image"), ("bad.avi", "", "video")]
    train = parse(catalog_text(train_rows))
    val = parse(catalog_text(val_rows))
    plan = selection.plan_conversion(train, str(tmp_path), val_catalog=val, subset=3, seed=0, media="video")
    for name, catalog in (("train", train), ("val", val)):
        selection.check_accounting(len(catalog.rows), [e for e in plan.train + plan.val if e.catalog == name],
                             [r for r in plan.rejects if r.catalog == name])
    assert len(plan.train) == 3 and all(e.media_type == "video" for e in plan.train)
    assert [e.source.file_path for e in plan.val] == ["v0.mp4"]  # the val image is not selected
    train_reasons = selection.count_reasons(r for r in plan.rejects if r.catalog == "train")
    assert train_reasons == {"duplicate of validation row": 2, "missing file": 1, "not in subset": 2,
                             "not selected": 5}
    assert selection.count_reasons(r for r in plan.rejects if r.catalog == "val") == {"empty caption": 1,
                                                                                 "not selected": 1}
    assert plan.subset.available == 5 and plan.subset.taken == 3 and not plan.subset.took_all


def test_check_accounting_catches_a_lost_row():
    pool = entries(2, 1)
    with pytest.raises(AssertionError, match="row accounting broken"):
        selection.check_accounting(4, pool, [])


# --- property-based: no generated catalogue crashes the converter or loses a row ----------------

FILE_NAMES = ["a.mp4", "b.MOV", "c.png", "d.jpg", "sub/e.webm", "f.gif", "missing.mp4", "x.txt", "noext"]


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    """The generated catalogues' media folder: every name in FILE_NAMES but missing.mp4, as empty files."""
    root = tmp_path_factory.mktemp("catalog-prop")
    for name in FILE_NAMES:
        if name != "missing.mp4":
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).touch()
    return str(root)


weird_text = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(list(',"\r\n\t \ufeff\u200b\x00') + list("한국어뉴스") + list(string.ascii_letters)),
    ),
    max_size=30,
)
file_paths = st.one_of(
    st.sampled_from(FILE_NAMES),
    st.sampled_from(["../a.mp4", "/etc/passwd.png", "./sub/../a.mp4", " c.png ", ""]),
    weird_text,
)
media_types = st.one_of(st.sampled_from(["video", "image", "Video", "IMAGE", " video ", ""]), weird_text)
captions = st.one_of(weird_text, st.sampled_from(["NA", "1", "true", "", "  "]))
any_rows = st.tuples(file_paths, captions, media_types)
likely_good_rows = st.tuples(
    st.sampled_from(FILE_NAMES[:6]), weird_text.map(lambda c: "장면 " + c), st.sampled_from(["video", "image", "Video"]),
).map(lambda row: (row[0], row[1], "image" if row[0].endswith(("png", "jpg")) else row[2]))
catalog_rows = st.lists(st.one_of(likely_good_rows, likely_good_rows, any_rows), max_size=25)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=catalog_rows, line_end=st.sampled_from(["\n", "\r\n"]), bom=st.booleans(),
       blank_every=st.integers(min_value=0, max_value=4), extra_column=st.booleans())
def test_generated_catalogs_never_lose_a_row(media_root, rows, line_end, bom, blank_every, extra_column):
    header = ("file_path", "caption", "media_type") + (("notes",) if extra_column else ())
    full_rows = [row + ("n",) for row in rows] if extra_column else rows
    text = catalog_text(full_rows, header, line_end)
    if blank_every:
        lines = text.split(line_end)
        # blank lines only between records whose quotes are balanced, i.e. real record ends
        rebuilt, open_quotes = [], False
        for index, line in enumerate(lines):
            rebuilt.append(line)
            open_quotes ^= line.count('"') % 2 == 1
            if not open_quotes and index % blank_every == 0 and index < len(lines) - 1:
                rebuilt.append("")
        text = line_end.join(rebuilt)
    data = (b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8")

    catalog = cat.parse_catalog_text(data.decode("utf-8-sig"), name="generated.csv")
    non_blank = [r for r in rows if "".join(r).strip() or extra_column]
    assert len(catalog.rows) == len(non_blank)

    plan = selection.plan_conversion(catalog, media_root, subset=5, seed=0)
    selection.check_accounting(len(catalog.rows), plan.train + plan.val, plan.rejects)

    # What DiffSynth reads back (pandas defaults) is exactly what was accepted.
    event(f"rows written: {min(len(plan.train), 3)}")
    written = pd.read_csv(io.StringIO(metadata_text(plan.train, None))) if plan.train else None
    if written is not None:
        assert list(written["prompt"]) == [e.source.caption for e in plan.train]
        assert list(written["video"]) == [e.relative_path for e in plan.train]
        assert all(isinstance(p, str) for p in written["prompt"])
