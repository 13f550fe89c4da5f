"""Keep every cache and temp file a test (or a subprocess it starts) makes inside pytest's tmp area."""

import os
import tempfile

import pytest

_SESSION_HOME = tempfile.mkdtemp(prefix="mbc-test-home-")
for _var, _sub in (("HF_HOME", "hf"), ("TORCH_EXTENSIONS_DIR", "torch_ext"), ("MODELSCOPE_CACHE", "modelscope"),
                   ("TRITON_CACHE_DIR", "triton"), ("MPLCONFIGDIR", "mpl")):
    os.environ.setdefault(_var, os.path.join(_SESSION_HOME, _sub))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A clean working directory for a test that runs commands writing relative paths."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
