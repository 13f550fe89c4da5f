"""Catalogue to metadata: the ``python -m diffsynth_mbc.convert`` command (``cli``)."""

from diffsynth_mbc.data.convert.cli import build_parser, main, metadata_text, spreadsheet_safe

__all__ = ["build_parser", "main", "metadata_text", "spreadsheet_safe"]
