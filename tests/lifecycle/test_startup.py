"""lifecycle/startup.py: the training's start-up without the cyclic garbage collector, and with it again after."""

from __future__ import annotations

import gc
import os

from diffsynth_mbc.lifecycle import startup


def test_the_collector_pauses_until_resumed_and_a_child_forked_meanwhile_runs_with_it():
    assert gc.isenabled()
    startup.pause_collector()
    try:
        assert not gc.isenabled()
        pid = os.fork()
        if pid == 0:   # a data-loader worker forked during set-up
            os._exit(0 if gc.isenabled() else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert not gc.isenabled()   # still paused here
    finally:
        startup.resume_collector()
    assert gc.isenabled()


def test_only_a_pause_taken_here_is_resumed():
    gc.disable()   # someone else's choice, e.g. a host process's
    try:
        startup.pause_collector()
        startup.resume_collector()
        assert not gc.isenabled()
    finally:
        gc.enable()
