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
# The temp files of this process and of the processes the tests start (Chromium's profile folders, the workers' own,
# torch's compiled C++ headers) stay in this session's folder too, whatever TMPDIR was. pytest keeps its tmp_path
# folders where it did (the temp folder chosen above): a failed test's files outlive the session's folder.
os.makedirs(os.path.join(_SESSION_HOME, "tmp"))
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
os.environ["TMPDIR"] = os.path.join(_SESSION_HOME, "tmp")
tempfile.tempdir = None   # chosen again, from TMPDIR, when next asked
# One folder for the whole test run, the pytest-xdist workers included (they inherit it from the controller, which
# removes it last): what one worker measured or started once for every worker (tests/forked_ranks.py).
os.environ.setdefault("MBC_TEST_RUN_SHARED", _SESSION_HOME)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pytest-xdist runs a worker per CPU and one more (pytest_xdist_auto_num_workers below): torch's thread pool in each
# worker, and in the processes it starts, gets its share of the CPUs, so that the workers' threads do not spin
# against each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


def _remove_session_home(owner_pid: int = os.getpid()) -> None:
    if os.getpid() == owner_pid:  # not in a forked rank that inherited this handler
        shutil.rmtree(_SESSION_HOME, ignore_errors=True)


atexit.register(_remove_session_home)


@pytest.fixture(scope="session")
def chromium():
    """One headless Chromium per test process (a start costs about a CPU-second), shared by the test modules that
    open pages; each module takes it through ``browser_helpers.browser_for_module``."""
    from browser_helpers import start_chromium

    driver = start_chromium(1400, 1800)
    yield driver
    driver.quit()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A clean working directory for a test that runs commands writing relative paths."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def pytest_collection_modifyitems(config, items):
    """Test files with the most slow tests first, each file's tests in their own order: the workers (pytest-xdist,
    a file at a time) start on the long files and end on short ones, so none waits alone on a long file at the end."""
    slow_per_file: dict = {}
    for item in items:
        slow_per_file[item.path] = slow_per_file.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    first_seen = {path: index for index, path in enumerate(slow_per_file)}
    items.sort(key=lambda item: (-slow_per_file[item.path], first_seen[item.path]))


def pytest_xdist_auto_num_workers(config):
    """``-n logical`` (pyproject.toml): one worker more than CPUs (``--maxprocesses`` caps it). Most slow tests wait
    on the processes they start; the extra worker keeps the CPUs busy meanwhile (2 cores: idle 17% -> 1%)."""
    return (os.cpu_count() or 1) + 1
