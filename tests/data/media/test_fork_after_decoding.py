"""A process that decoded frames can fork workers: the garbage a decoder left is collected before the fork, not freed
in the child, where FFmpeg's frame converter waits forever for slice threads the child does not have."""

import gc
import os
import signal
import subprocess
import time

import av
import numpy as np

import diffsynth_mbc.data.media.clip_reader  # noqa: F401  (what every decoding process imports)


def converter_garbage() -> None:
    """A converted frame (its swscale context runs slice threads) left in a reference cycle: only the garbage
    collector frees it."""
    frame = av.VideoFrame.from_ndarray(np.zeros((64, 96, 3), np.uint8), format="rgb24")
    cycle = [frame, frame.reformat(width=48, height=32, format="yuv420p")]
    cycle.append(cycle)


def test_a_child_forked_after_decoding_collects_its_garbage_and_exits():
    gc.disable()   # the garbage stays until the fork, as between two collections of a busy process
    try:
        converter_garbage()
        pid = os.fork()
        if pid == 0:
            gc.collect()   # a worker's first collection
            os._exit(0)
    finally:
        gc.enable()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung freeing the decoder's garbage")


def full_collections_during(action) -> int:
    collections = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            collections.append(info)

    gc.callbacks.append(count)
    try:
        action()
    finally:
        gc.callbacks.remove(count)
    return len(collections)


def fork_and_wait():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_only_a_fork_that_runs_python_collects_not_one_that_starts_a_program():
    """imageio's ffmpeg writer starts ffmpeg with a preexec_fn, which makes subprocess fork (not spawn): a full
    collection before each clip written cost a process with torch loaded 0.1-0.5 s, for a child that execs."""
    assert full_collections_during(fork_and_wait) == 1
    assert full_collections_during(lambda: subprocess.run(["true"], preexec_fn=os.setpgrp, check=True)) == 0
