"""Keep every cache and temp file a test (or a subprocess it starts) makes inside pytest's tmp area."""

import atexit
import os
import shutil
import tempfile

import pytest

_SESSION_HOME = tempfile.mkdtemp(prefix="mbc-test-home-")
for _var, _sub in (("HF_HOME", "hf"), ("TORCH_EXTENSIONS_DIR", "torch_ext"), ("MODELSCOPE_CACHE", "modelscope"),
                   ("TRITON_CACHE_DIR", "triton"), ("MPLCONFIGDIR", "mpl")):
    os.environ.setdefault(_var, os.path.join(_SESSION_HOME, _sub))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _remove_session_home(owner_pid: int = os.getpid()) -> None:
    if os.getpid() == owner_pid:  # not in a forked rank that inherited this handler
        shutil.rmtree(_SESSION_HOME, ignore_errors=True)


atexit.register(_remove_session_home)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A clean working directory for a test that runs commands writing relative paths."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
