"""Files written atomically get the mode a plain open() would give them (umask respected)."""

import json
import os
import stat

import pytest

from diffsynth_mbc.atomic import atomic_path, atomic_write_json, atomic_write_text, current_umask


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_files_are_readable_by_others_like_a_plain_open(tmp_path, umask_022):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write_text(tmp_path / "status.json", "{}")
    atomic_write_json(tmp_path / "other.json", {"a": 1})
    assert mode(tmp_path / "status.json") == mode(plain) == 0o644
    assert mode(tmp_path / "other.json") == 0o644
    assert json.loads((tmp_path / "other.json").read_text()) == {"a": 1}


def test_a_stricter_umask_is_respected(tmp_path):
    previous = os.umask(0o077)
    try:
        assert current_umask() == 0o077
        atomic_write_text(tmp_path / "private.txt", "secret")
    finally:
        os.umask(previous)
    assert mode(tmp_path / "private.txt") == 0o600


def test_no_temp_file_is_left_when_writing_fails(tmp_path):
    with pytest.raises(TypeError):
        atomic_write_json(tmp_path / "bad.json", {"x": object()})
    assert list(tmp_path.iterdir()) == []


def test_keep_if_same_leaves_an_identical_file_and_its_mtime_alone(tmp_path):
    target = tmp_path / "clip.bin"
    target.write_bytes(b"same bytes")
    os.utime(target, (1_000_000, 1_000_000))
    with atomic_path(target, keep_if_same=True) as temp:
        temp.write_bytes(b"same bytes")
    assert target.stat().st_mtime == 1_000_000 and os.listdir(tmp_path) == ["clip.bin"]
    with atomic_path(target, keep_if_same=True) as temp:
        temp.write_bytes(b"new bytes")
    assert target.read_bytes() == b"new bytes" and os.listdir(tmp_path) == ["clip.bin"]


METADATA = {k: "v" + k for k in ("run_id", "step", "lora_rank", "lora_alpha", "base_model", "é")}


@pytest.mark.slow   # starts a Python process that imports torch
def test_the_same_tensors_and_metadata_save_the_same_bytes_in_any_process(tmp_path):
    """safetensors writes the metadata in the order of a hash map with random keys, new for each map: each save, in
    this process or in another, would write other bytes (the test failed before; the raw bytes are shown to differ
    here, so it still can). Eight saves here and one in a process of its own write the same file, and it loads."""
    import subprocess
    import sys

    import torch
    from safetensors import safe_open
    from safetensors.torch import save

    from diffsynth_mbc.atomic import atomic_save_safetensors

    elsewhere = tmp_path / "elsewhere.safetensors"
    script = ("import sys, torch; from diffsynth_mbc.atomic import atomic_save_safetensors; "
              "atomic_save_safetensors(sys.argv[1], {'b': torch.arange(6.).reshape(2, 3), 'a': torch.ones(5)}, "
              f"{METADATA!r})")
    subprocess.run([sys.executable, "-c", script, str(elsewhere)], check=True)
    tensors = {"b": torch.arange(6.).reshape(2, 3), "a": torch.ones(5)}
    raw = {save(tensors, metadata=METADATA) for _ in range(8)}
    assert len(raw) > 1, "safetensors wrote the metadata in one order every time: this test would show nothing"
    here = [tmp_path / f"{n}.safetensors" for n in range(8)]
    for path in here:
        atomic_save_safetensors(path, tensors, METADATA)
    assert {path.read_bytes() for path in [elsewhere, *here]} == {elsewhere.read_bytes()}
    with safe_open(str(elsewhere), "pt") as handle:
        assert handle.metadata()["é"] == "vé" and handle.get_tensor("b")[1, 2] == 5
