"""What ``doctor --probe`` reads back from its runs: the GPU peak the status file's reader writes, and the cache
build's encode rate without its start-up. Pure: the runs themselves are tested in test_doctor_probe.py."""

from __future__ import annotations

import pytest

from diffsynth_mbc.doctor.step_probe import encode_seconds_per_row, summarise
from diffsynth_mbc.gpu import MemoryPeaks


def test_the_gpu_peak_is_the_runs_peak_as_the_status_files_reader_writes_it():
    peaks = MemoryPeaks()
    peaks.fields(36 * 2**30, 37 * 2**30)   # a reading during the steps
    gpu = {"name": "NVIDIA H200", **peaks.fields(12 * 2**30, 13 * 2**30)}   # the last: a lower peak since
    steps = [{"step_time_s": seconds, "samples": 1, "shapes": [[17, 704, 1280]]} for seconds in (13.0, 0.3, 0.27, 0.28)]
    figure = summarise({"steps": steps, "status": {"gpu": gpu}, "rss": None}, 2, 4, None)
    assert figure["max_allocated_mb"] == 36 * 1024   # the run's peak, not the last reading's
    assert figure["seconds_per_step"] == pytest.approx(0.275) and figure["first_steps_s"] == [13.0, 0.3]


def test_the_encode_rate_runs_from_the_first_encoded_row_to_the_last():
    # 4 rows: the first done 6.2 s after the start (models loaded in 4 s, workers started, kernels chosen)
    stats = {"written": 4, "seconds": 9.6, "model_load_seconds": 4.0, "first_row_done_s": 6.2, "last_row_done_s": 7.34}
    assert encode_seconds_per_row(stats) == pytest.approx(0.38)
    # one row: nothing to span, so that row after the load; a cache of an older build has no row times
    assert encode_seconds_per_row({"written": 1, "seconds": 5.0, "model_load_seconds": 4.0,
                                   "first_row_done_s": 4.9, "last_row_done_s": 4.9}) == pytest.approx(1.0)
    assert encode_seconds_per_row({"written": 4, "seconds": 9.6, "model_load_seconds": 4.0}) == pytest.approx(1.4)
    assert encode_seconds_per_row({"written": 0, "seconds": 4.1, "model_load_seconds": 4.0}) is None


def test_the_largest_residual_is_read_back_with_fp16s_headroom_and_said():
    from diffsynth_mbc.doctor.report import residual_line

    steps = [{"step_time_s": 0.3, "samples": 1}] * 3
    for largest, fp32, headroom, said in (
            (12000.0, False, 5.459, "largest residual magnitude: 12,000 (5.5x headroom below fp16's 65,504; the "
                                    "stream in the model's dtype)"),
            (80000.0, True, 0.819, "largest residual magnitude: 80,000 (1.22x past fp16's 65,504, held by the fp32 "
                                   "residual stream; the stream in fp32)"),
            (80000.0, False, 0.819, "largest residual magnitude: 80,000 (1.22x past fp16's 65,504: fp16 overflows "
                                    "here without --fp32_residual on; the stream in the model's dtype)"),
            ("inf", False, None, "largest residual magnitude: inf (the residual stream, in the model's dtype, "
                                 "overflowed): --fp32_residual on keeps it in fp32")):
        figure = summarise({"steps": steps, "status": {"largest_residual": largest, "fp32_residual": fp32},
                            "rss": None}, 1, 1, None)
        assert figure["largest_residual"] == largest and figure["fp16_headroom"] == headroom
        assert residual_line(figure) == said
    assert residual_line(summarise({"steps": steps, "status": {}, "rss": None}, 1, 1, None)) is None
