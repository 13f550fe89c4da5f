"""The step's progress component: its history record names the metadata rows the step trained."""

from __future__ import annotations

import json

from diffsynth_mbc.training.components.progress import StepProgress
from diffsynth_mbc.training.components.protocol import StepContext, StepResult
from diffsynth_mbc.training.reporting.progress import ProgressLogger
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter


def test_each_step_record_names_the_rows_it_trained_0_based(tmp_path):
    status = RankStatusWriter(tmp_path / "logs", "run-r", 0, 0, 1)
    logger = ProgressLogger(str(tmp_path / "out"), status, steps_per_epoch=2, num_epochs=1, samples_per_step=3)
    progress = StepProgress(logger, accelerator=None)
    logger.on_train_begin()
    for step, rows in ((1, [4, 0, 4]), (2, [10])):   # a row twice in one step: two of its copies (the repeat)
        progress.after_step(StepContext(step=step, epoch=0, total_steps=2, result=StepResult(
            loss=0.5, lr=1e-4, grad_norm=1.0, skipped=False, samples=len(rows), tokens=12, rows=rows)))
    status.close()
    records = [json.loads(line) for line in (tmp_path / "logs" / "training_gpu0.jsonl").read_text().splitlines()]
    assert [(record["step"], record["rows"], record["samples"]) for record in records] == [(1, [4, 0, 4], 3),
                                                                                          (2, [10], 1)]
