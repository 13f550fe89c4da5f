"""The inspection's measure store: a second run over unchanged files reuses what the first measured, a changed
file or setting is measured again, a killed run's lines are reused, and adding rows never rewrites the file."""

from __future__ import annotations

import json
import os

import pytest

from diffsynth_mbc.data.inspect.measure_store import STORE_NAME, MeasureStore

SETTINGS = {"frames": 8, "stride": 2, "start": "middle"}
MEASURES = {"scene_cut": 0.12, "black": 0.01, "frozen": 3.5, "letterbox": [0, 0], "thumb_frames": [0, 2, 4]}


@pytest.fixture
def clip(tmp_path):
    path = tmp_path / "clips" / "a.mp4"
    path.parent.mkdir()
    path.write_bytes(b"\x00" * 100)
    return path


def test_a_second_run_reuses_what_the_first_measured(tmp_path, clip):
    key = MeasureStore.key(str(clip), SETTINGS)
    with MeasureStore(tmp_path / STORE_NAME, version=1) as first:
        assert first.get(key) is None and (first.hits, first.misses) == (0, 1)
        first.add(key, MEASURES)
        assert first.get(key) == MEASURES   # this run's own rows too
        first.finish({key})
    second = MeasureStore(tmp_path / STORE_NAME, version=1)
    assert second.get(key) == MEASURES and (second.hits, second.misses) == (1, 0)
    second.finish({key})


def test_the_key_follows_the_real_file_and_the_settings(tmp_path, clip):
    link = tmp_path / "link.mp4"
    link.symlink_to(clip)
    key = MeasureStore.key(str(clip), SETTINGS)
    assert MeasureStore.key(str(link), SETTINGS) == key                      # the same file by another name
    assert MeasureStore.key(str(clip), dict(reversed(SETTINGS.items()))) == key   # the settings' order is not a change
    assert MeasureStore.key(str(clip), {**SETTINGS, "stride": 3}) != key
    assert MeasureStore.key(str(tmp_path / "missing.mp4"), SETTINGS) is None


@pytest.mark.parametrize("change", ["mtime", "size"])
def test_a_changed_file_is_measured_again(tmp_path, clip, change):
    store = MeasureStore(tmp_path / STORE_NAME, version=1)
    store.add(MeasureStore.key(str(clip), SETTINGS), MEASURES)
    store.close()
    if change == "mtime":
        stat = clip.stat()
        os.utime(clip, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    else:
        clip.write_bytes(b"\x00" * 101)
    again = MeasureStore(tmp_path / STORE_NAME, version=1)
    assert again.get(MeasureStore.key(str(clip), SETTINGS)) is None and again.misses == 1


def test_other_window_settings_miss(tmp_path, clip):
    with MeasureStore(tmp_path / STORE_NAME, version=1) as store:
        store.add(MeasureStore.key(str(clip), SETTINGS), MEASURES)
    again = MeasureStore(tmp_path / STORE_NAME, version=1)
    assert again.get(MeasureStore.key(str(clip), {**SETTINGS, "frames": 16})) is None


def test_a_torn_last_line_is_ignored_and_the_rest_reused(tmp_path):
    path = tmp_path / STORE_NAME
    with MeasureStore(path, version=1) as store:
        for n in range(5):
            store.add(f"key-{n}", {"n": n, "text": "é" * 3})
    data = path.read_bytes()
    last_line = data.splitlines()[-1]
    path.write_bytes(data[:-len(last_line) // 2])   # killed mid-write: half the last line, no newline
    resumed = MeasureStore(path, version=1)
    assert [resumed.get(f"key-{n}") for n in range(5)] == [{"n": n, "text": "ééé"} for n in range(4)] + [None]
    resumed.add("key-4", {"n": 4})   # the next line does not run on from the torn one
    resumed.close()
    assert MeasureStore(path, version=1).get("key-4") == {"n": 4}
    resumed.finish({f"key-{n}" for n in range(5)})
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 5 and all(json.loads(line)["version"] == 1 for line in lines)   # the torn line is gone


def test_a_line_torn_inside_a_character_spoils_only_itself(tmp_path):
    path = tmp_path / STORE_NAME
    with MeasureStore(path, version=1) as store:
        store.add("key-0", {"n": 0})
    with open(path, "ab") as handle:
        handle.write('{"key": "key-1", "measures": {"path": "é'.encode("utf-8")[:-1])   # half of "é"
    assert MeasureStore(path, version=1).get("key-0") == {"n": 0}


def test_a_version_bump_ignores_the_old_lines(tmp_path):
    path = tmp_path / STORE_NAME
    with MeasureStore(path, version=1) as old:
        old.add("key", MEASURES)
    new = MeasureStore(path, version=2)
    assert new.get("key") is None
    new.add("key", {"scene_cut": 0.5})
    new.finish({"key"})
    assert MeasureStore(path, version=2).get("key") == {"scene_cut": 0.5}
    assert MeasureStore(path, version=1).get("key") is None   # compaction dropped version 1's line


def test_finish_keeps_the_used_keys_and_drops_the_rest(tmp_path):
    path = tmp_path / STORE_NAME
    store = MeasureStore(path, version=1)
    for n in range(6):
        store.add(f"key-{n}", {"n": n})
    store.finish({"key-1", "key-4", "key-not-measured"})
    assert sorted(json.loads(line)["key"] for line in path.read_text().splitlines()) == ["key-1", "key-4"]
    assert [p.name for p in tmp_path.iterdir()] == [STORE_NAME]   # no temp file left beside it
    store.finish({"key-1", "key-4"})   # again: harmless
    reread = MeasureStore(path, version=1)
    assert [reread.get(f"key-{n}") for n in range(6)] == [None, {"n": 1}, None, None, {"n": 4}, None]


def test_finish_rewrites_nothing_when_nothing_changed(tmp_path):
    path = tmp_path / STORE_NAME
    first = MeasureStore(path, version=1)
    first.add("key", MEASURES)
    first.finish({"key"})
    inode = path.stat().st_ino
    second = MeasureStore(path, version=1)
    second.get("key")
    second.finish({"key"})
    assert path.stat().st_ino == inode


def test_an_unused_store_creates_no_file(tmp_path):
    store = MeasureStore(tmp_path / "out" / STORE_NAME, version=1)
    store.finish(set())
    assert not (tmp_path / "out").exists()


def test_a_failed_run_keeps_what_it_measured(tmp_path):
    path = tmp_path / STORE_NAME
    with pytest.raises(RuntimeError):
        with MeasureStore(path, version=1) as store:
            store.add("key-0", {"n": 0})
            raise RuntimeError("decoder crashed")
    assert MeasureStore(path, version=1).get("key-0") == {"n": 0}


def test_adding_many_rows_only_appends(tmp_path):
    """10,000 rows: the file keeps its inode and only grows; each add is one line, never a rewrite."""
    path = tmp_path / STORE_NAME
    store = MeasureStore(path, version=1)
    store.add("key-0", MEASURES)
    inode, size = path.stat().st_ino, path.stat().st_size
    for n in range(1, 10_000):
        store.add(f"key-{n}", MEASURES)
        if n % 500 == 0:
            stat = path.stat()
            assert stat.st_ino == inode and stat.st_size > size   # flushed as it goes, never shrunk
            size = stat.st_size
    store.close()
    assert len(path.read_bytes().splitlines()) == 10_000 and path.stat().st_ino == inode
