"""Plain lines for output that is not a terminal: wrapped between words only, with a hanging indent.

A pipe, ``tee`` or a CI log has no real width (rich assumes 80 columns) and no use for box drawing: a record per
line that ``grep`` finds, with its details indented below, reads best there. A renderable built on
``PlainLines`` draws ``table()`` on a terminal and ``lines()`` anywhere else.
"""

from __future__ import annotations

import sys
import textwrap
from typing import Any, Iterator

from rich.console import Console, RenderableType
from rich.text import Text

from ampdoctor.core.views import Line

__all__ = ["INDENT", "PlainLines", "Printer", "Sentence", "console", "encodable", "wrap", "wrap_code"]

INDENT = "    "


def console(stderr: bool = False, *, file: Any = None, kernel: bool = False) -> Console:
    """Return the console ampdoctor prints to: every entry point's, from here.

    Off a terminal rich would cut a line at its width in the middle of a name, where ``wrap`` keeps a name longer
    than the line whole: every plain line is written as it is made. ``file``: another stream than stdout/stderr (a
    terminal IPython's ``sys.stdout`` as it is now); ``kernel``: a notebook's kernel, where rich writes HTML with a
    text part, ``KERNEL_WIDTH`` columns wide (rich's default there is 115).
    """
    if kernel:
        return Console(force_jupyter=True, width=KERNEL_WIDTH, highlight=False)
    stream = file if file is not None else sys.stderr if stderr else sys.stdout
    out = Console(file=encodable(stream), highlight=False)
    out.soft_wrap = not out.is_terminal
    return out


# what ampdoctor's own text uses beyond ASCII, in ASCII, for a stream that cannot encode it (PYTHONIOENCODING=ascii,
# a C locale): a character still left over is written as "?"
_ASCII = str.maketrans({"≈": "~", "·": "*", "—": "-", "–": "-", "…": "...", "→": "->", "←": "<-", "×": "x",
                        "≤": "<=", "≥": ">=", "≠": "!=", "‘": "'", "’": "'", "“": '"', "”": '"', "∞": "inf",
                        "▲": "^", "▼": "v", "─": "-", "━": "=", "│": "|", "µ": "u", "²": "^2", "√": "sqrt",
                        "±": "+-", "✓": "ok", "✗": "x", "•": "*"})


def encodable(stream: Any) -> Any:
    """Return ``stream``, or where its encoding cannot write ampdoctor's text (``≈``, ``·``), a stream that writes
    that text in ASCII: a message must reach the user whatever their locale, never as a UnicodeEncodeError."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        "≈·—…→".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return _Encoded(stream, encoding)
    return stream


class _Encoded:
    """A text stream that writes what its encoding cannot as ASCII (``_ASCII``), else ``?``; the rest is the
    stream's own."""

    def __init__(self, stream: Any, encoding: str) -> None:
        self._stream, self._encoding = stream, encoding

    def write(self, text: str) -> int:
        text = text.translate(_ASCII)
        try:
            text.encode(self._encoding)
        except (UnicodeEncodeError, LookupError):
            text = text.encode("ascii", "replace").decode("ascii")
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


KERNEL_WIDTH = 80


class Printer:
    """Print what a run says on a console made at its first line (``console``'s arguments): ampdoctor's lines (text
    or a `Line`) wrapped between words from column 0, under an open tqdm bar too, and report views drawn by
    ``ampdoctor.ui``. Every entry point prints through one (``core.views.printer``), so each says the same.

    >>> import io
    >>> out = Printer(file=io.StringIO())
    >>> out("ampdoctor: a line"); out.console.file.getvalue()
    'ampdoctor: a line\\n'
    """

    def __init__(self, stderr: bool = True, *, file: Any = None, kernel: bool = False, out: Console | None = None
                 ) -> None:
        self._made = out
        self._how = (stderr, file, kernel)

    @property
    def console(self) -> Console:
        """The console, made when first used (a test may have replaced the stream since the printer was made)."""
        if self._made is None:
            stderr, file, kernel = self._how
            self._made = console(stderr, file=file, kernel=kernel)
        return self._made

    def __call__(self, item: Any) -> None:
        """Print ``item``: a line of ampdoctor's (``str`` or `Line`), or a data object ``ampdoctor.ui`` draws."""
        from ampdoctor._compat.tqdm import clear_of_bars

        out = self.console
        with clear_of_bars(out.file):   # a tqdm bar left open: start at column 0
            if isinstance(item, (str, Line)):
                out.print(Line(item) if isinstance(item, str) else item, soft_wrap=True, highlight=False)
            else:
                out.print(item)


def wrap(text: str, width: int, first: str = "", rest: str = INDENT) -> list[str]:
    """Return ``text`` as lines of at most ``width`` columns: ``first`` starts it, ``rest`` starts every later line.

    Its own line breaks and leading spaces are kept. A word is never broken: a module name or a number too long
    for an indented line gives up as much of the indent as it needs to fit, never all of it, and one that fits
    only at column 0 or not at all stays whole under the full indent, past ``width``: a line at column 0 always
    begins a record (a finding, a section).

    >>> wrap("fc1.weight is trainable float16 while the GradScaler is on", 30, "AMP101 ")
    ['AMP101 fc1.weight is trainable', '    float16 while the', '    GradScaler is on']
    >>> wrap("tensors (a.long.module.name.weight, b)", 30)
    ['tensors', '   (a.long.module.name.weight,', '    b)']
    >>> wrap("in bert.encoder.layer.0.attention.output.LayerNorm.weight", 30)
    ['in', '    bert.encoder.layer.0.attention.output.LayerNorm.weight']
    """
    lines: list[str] = []
    for paragraph in text.split("\n"):
        lead = rest if lines else first
        lines += textwrap.wrap(paragraph, max(width, len(lead) + 1), initial_indent=lead, subsequent_indent=rest,
                               break_long_words=False, break_on_hyphens=False) or [lead.rstrip()]
    return [_fit(line, width) for line in lines]


def _fit(line: str, width: int) -> str:
    """Return ``line`` moved left by what it is over ``width``, if its indent has more than that to give."""
    over, indent = len(line) - width, len(line) - len(line.lstrip(" "))
    return line[over:] if 0 < over < indent else line


def wrap_code(line: str, width: int, indent: str = INDENT) -> list[str]:
    """Return a line of example code as lines that still paste as Python: the code is never broken, and a comment
    too long for the line goes on in comment lines under its ``#``.

    >>> for line in wrap_code("opt = AdamW(params, eps=1e-4)   # or fused=True (adds eps in fp32, in its kernel)", 70):
    ...     print(line)
        opt = AdamW(params, eps=1e-4)   # or fused=True (adds eps in fp32,
                                        # in its kernel)
    >>> wrap_code("opt = AdamW(params, eps=1e-4)   # or fused=True (adds eps in fp32)", 50)  # no room under "#"
    ['    opt = AdamW(params, eps=1e-4)   # or', '    # fused=True (adds eps in fp32)']
    >>> wrap_code("# by hand: for p in model.parameters(): upcast", 30)
    ['    # by hand: for p in', '    # model.parameters():', '    # upcast']
    """
    before, comment = _split_comment(indent + line)
    if not comment or len(before + comment) <= width:
        return [before + comment]
    # under the "#" while a comment line there holds a few words, else at the code's own indentation
    under = len(before) if width - len(before) >= _COMMENT_ROOM else len(before) - len(before.lstrip())
    return wrap(comment[1:].strip(), width, before + "# ", " " * under + "# ")


_COMMENT_ROOM = 30  # columns a comment continued under its "#" keeps for its words


def _split_comment(line: str) -> tuple[str, str]:
    """Split ``line`` at its ``#`` comment (one outside a string literal): the code with the spaces before it."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote and line[i - 1] != "\\" else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return line[:i], line[i:]
    return line, ""


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
