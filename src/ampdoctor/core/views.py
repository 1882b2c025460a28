"""The one seam between data and the UI: a data object that rich can print is drawn by ``ampdoctor.ui``.

Data never imports the UI (the layers in ``pyproject.toml``; ``lint-imports`` checks them). Yet ``rich.print(report)``
and ``rich.print(watch.summary())`` are public API: such an object asks ``ampdoctor.ui.views.draw`` for its
renderable when rich draws it, looked up by name at that moment. This is the only place that does so; it adds no
import edge, so no layer depends on the UI, and the UI stays free to change how anything looks.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["Drawn", "Line", "printer", "display_page"]

_DRAWING = "ampdoctor.ui.views"


class Drawn:
    """A data object that rich draws through ``ampdoctor.ui.views.draw`` (see the module's description)."""

    def __rich__(self) -> Any:
        return importlib.import_module(_DRAWING).draw(self)


class Line(Drawn):
    """One line of ampdoctor's own (``ampdoctor --fix: upcast ...``, ``ampdoctor: report written to ...``): it starts
    at column 0 and is wrapped between words to the width it is drawn at, later lines indented; ``whole`` keeps it
    on one line (a line built around a path, to copy). Print it with ``soft_wrap=True``, so nothing crops a whole
    line."""

    def __init__(self, text: str, whole: bool = False) -> None:
        self.text, self.whole = text, whole

    def __repr__(self) -> str:
        return f"Line({self.text!r}{', whole=True' if self.whole else ''})"


def printer(stderr: bool = True, *, kernel: bool = False, file: Any = None) -> Callable[[Any], None]:
    """Return what prints a run's lines and report views, on a console made at its first line
    (``ampdoctor.ui.plain.Printer``): the one console factory of every entry point, through this seam.

    Args:
        stderr: print to stderr (else stdout, or ``file``).
        kernel: a notebook kernel's rich output (HTML with a text part).
        file: another stream (a terminal IPython's ``sys.stdout``).
    """
    return importlib.import_module(_DRAWING).printer(stderr=stderr, kernel=kernel, file=file)


def display_page(data: Any) -> None:
    """Show the self-contained HTML page of ``data`` (a report), as ``ampdoctor report --html`` writes it, inline in
    the notebook that runs this (``ampdoctor.ui.views.display_page``, through this seam)."""
    importlib.import_module(_DRAWING).display_page(data)
