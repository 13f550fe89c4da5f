"""A training process's start-up without the cyclic garbage collector.

Importing torch, DiffSynth (with transformers) and peft leaves about 420,000 objects tracked by the collector
that live as long as the process, and almost no cyclic garbage, yet the collector makes 7 full passes over them
while they are created: about 1 of the 8 CPU-seconds of each rank of the launched demo (``gc.callbacks``);
``benchmarks/bench_startup.py``: 5.6 CPU-s for the imports and the demo pipeline, 4.6 paused.
``python -m diffsynth_mbc.train`` pauses the collector before its imports and the training resumes it once it
is set up, before the first step; a process forked meanwhile (a data-loader worker) runs with it on. Only a
pause taken here is resumed: a test calling the training's ``main`` in its own process keeps its collector as
it is. Reference counting frees everything else as usual throughout.
"""

from __future__ import annotations

import gc
import os

_paused = False


def pause_collector() -> None:
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collector() -> None:
    global _paused
    if _paused:
        _paused = False
        gc.enable()


os.register_at_fork(after_in_child=resume_collector)
