"""Catalogue to metadata: the ``python -m diffsynth_mbc.convert`` command.

``cli`` (the command: options, their checks, the run), ``probe_rejects`` (--probe: unreadable files rejected,
short, small or much cropped ones flagged), ``aspect_mix`` (the training shapes: what is small or cropped, the
orientation and aspect mix), ``outputs`` (the files written: names, columns, CSV texts), ``report``
(summary.json and the printed table).
"""

from diffsynth_mbc.data.convert.cli import UsageError, build_parser, main, run
from diffsynth_mbc.data.convert.outputs import (
    OUTPUT_NAMES,
    flagged_text,
    left_out_text,
    metadata_text,
    rejects_text,
    spreadsheet_safe,
)
from diffsynth_mbc.data.convert.probe_rejects import Flag, ProbeOutcome, short_video_reason

__all__ = ["OUTPUT_NAMES", "Flag", "ProbeOutcome", "UsageError", "build_parser", "flagged_text", "left_out_text",
           "main", "metadata_text", "rejects_text", "run", "short_video_reason", "spreadsheet_safe"]
