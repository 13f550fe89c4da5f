"""Catalogue to metadata: the ``python -m diffsynth_mbc.convert`` command.

``cli`` (the command: options, their checks, the run), ``probing`` (--probe: unreadable files rejected,
short or small ones flagged), ``outputs`` (the files written: names, columns, CSV texts), ``report``
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
