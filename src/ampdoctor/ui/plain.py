"""Plain lines for output that is not a terminal: wrapped between words only, with a hanging indent.

A pipe, ``tee`` or a CI log has no real width (rich assumes 80 columns) and no use for box drawing: a record per
line that ``grep`` finds, with its details indented below, reads best there. A renderable built on
``PlainLines`` draws ``table()`` on a terminal and ``lines()`` anywhere else.
"""

from __future__ import annotations

import textwrap
from typing import Any, Iterator

from rich.console import RenderableType
from rich.text import Text

__all__ = ["INDENT", "PlainLines", "Sentence", "wrap"]

INDENT = "    "


def wrap(text: str, width: int, first: str = "", rest: str = INDENT) -> list[str]:
    """Return ``text`` as lines of at most ``width`` columns: ``first`` starts it, ``rest`` starts every later line.

    Its own line breaks and leading spaces are kept. A word is never broken: a module name or a number too long
    for an indented line loses as much of the indent as it needs, and one longer than the line stays whole on a
    line of its own.

    >>> wrap("fc1.weight is trainable float16 while the GradScaler is on", 30, "AMP101 ")
    ['AMP101 fc1.weight is trainable', '    float16 while the', '    GradScaler is on']
    >>> wrap("tensors (a.long.module.name.weight, b)", 30)
    ['tensors', '   (a.long.module.name.weight,', '    b)']
    """
    lines: list[str] = []
    for paragraph in text.split("\n"):
        lead = rest if lines else first
        lines += textwrap.wrap(paragraph, max(width, len(lead) + 1), initial_indent=lead, subsequent_indent=rest,
                               break_long_words=False, break_on_hyphens=False) or [lead.rstrip()]
    return [line[min(len(line) - width, len(line) - len(line.lstrip(" "))):] if len(line) > width else line
            for line in lines]


class PlainLines:
    """A renderable with two layouts, chosen when it is drawn: ``table()`` on a terminal, ``lines()`` elsewhere."""

    def lines(self, width: int) -> Iterator[Text]:
        """Yield the plain lines, each at most ``width`` columns unless one word is longer."""
        raise NotImplementedError

    def table(self, width: int) -> RenderableType:
        """Return the terminal layout."""
        raise NotImplementedError

    def __rich_console__(self, console: Any, options: Any) -> Iterator[RenderableType]:
        if console.is_terminal:
            yield self.table(options.max_width)
        else:
            yield from self.lines(options.max_width)


class Sentence:
    """A message drawn as ``wrap`` lines at the width it is drawn at: no trailing space, later lines indented."""

    def __init__(self, text: str, style: str = "") -> None:
        self.text, self.style = text, style

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Text]:
        for line in wrap(self.text, options.max_width):
            yield Text(line, style=self.style)
