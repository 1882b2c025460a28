"""How each data object of ampdoctor is drawn when rich prints it (see ``ampdoctor.core.views``)."""

from __future__ import annotations

from functools import singledispatch
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from ampdoctor.advice.advisor import Advice
from ampdoctor.core.report import Report, ReportView
from ampdoctor.core.views import Line
from ampdoctor.monitor.watcher import WatchView
from ampdoctor.ui.advice_view import render_advice
from ampdoctor.ui.console import render_report
from ampdoctor.ui.plain import Printer, Sentence
from ampdoctor.ui.watch_view import render_watch

__all__ = ["draw", "display_page", "printer", "render_view"]


def render_view(view: ReportView) -> RenderableType:
    """Return the parts of a report that ``view`` asks for: the watch's summary, then the findings or verdict."""
    parts: list[RenderableType] = []
    watch = view.report.watch
    if view.watch and watch is not None and watch.steps:
        parts.append(render_watch(watch, None))   # its findings are in the report's one table
    if view.findings:
        parts.append(render_report(view.report, show_exception=view.exception))
    return Group(*parts)


@singledispatch
def draw(data: Any) -> RenderableType:
    """Return the rich renderable of ``data``, one of ampdoctor's data objects."""
    raise TypeError(f"ampdoctor.ui has no drawing for {type(data).__name__}")


@draw.register
def _(report: Report) -> RenderableType:
    return render_report(report)


@draw.register
def _(view: ReportView) -> RenderableType:
    return render_view(view)


@draw.register
def _(view: WatchView) -> RenderableType:
    return render_watch(view.summary, view.findings)


@draw.register
def _(advice: Advice) -> RenderableType:
    return render_advice(advice)


@draw.register
def _(line: Line) -> RenderableType:
    return Text(line.text) if line.whole else Sentence(line.text)


def printer(stderr: bool = True, *, kernel: bool = False, file: Any = None) -> Printer:
    """Return the printer of an entry point (``core.views.printer``)."""
    return Printer(stderr, kernel=kernel, file=file)


def display_page(report: Report) -> None:
    """Show the HTML page of ``report`` that ``ampdoctor report --html`` would write of its JSON, inline in the
    notebook (in an iframe, so its styles stay out of the notebook's)."""
    import html

    from IPython.display import display

    from ampdoctor.ui.report_files import Loaded, render_html

    page = render_html(Loaded(path="this notebook", report=report))
    frame = (f'<iframe srcdoc="{html.escape(page, quote=True)}" title="ampdoctor report" '
             'style="width:100%;height:640px;border:1px solid #ddd"></iframe>')
    # A raw MIME bundle: IPython's HTML() warns "Consider using IPython.display.IFrame instead" for any text that
    # starts with <iframe and ends with </iframe>, and IFrame shows a URL (src), not a page of its own (srcdoc).
    display({"text/html": frame, "text/plain": "ampdoctor report (HTML; %ampdoctor prints it as text)"}, raw=True)
