"""The converter's terminal: rich's Console, except that no control character of the text it prints reaches the
terminal (a file named with ``ESC[2J`` or an OSC title sequence is shown, not obeyed), as the monitor shows files."""

from __future__ import annotations

from rich.console import Console
from rich.segment import Segment

from diffsynth_mbc.values import printable


class PrintableConsole(Console):
    """Every text segment passes through ``printable``; rich's own styles and controls (colours, the progress
    line's cursor moves) are rendered as rich renders them."""

    def _render_buffer(self, buffer) -> str:
        return super()._render_buffer(segment if segment.control else
                                      Segment(printable(segment.text), segment.style, segment.control)
                                      for segment in buffer)
