"""The IPython extension: ``%load_ext ampdoctor`` gives a notebook's kernel the diagnosis of ``ampdoctor run``.

In Jupyter, JupyterLab, Colab, Kaggle or a terminal IPython::

    %load_ext ampdoctor      # from now on: pre-flight, guard and watch of whatever the cells train
    ...                      # a cell that raises gets the crash explanation under its traceback
    %ampdoctor               # the findings and the watch's summary so far
    %ampdoctor --fix         # repairs on for the following cells (also: %ampdoctor fix on)
    %unload_ext ampdoctor    # every hook removed, as at the end of ``ampdoctor run``

The kernel is one long process, so a `NotebookDoctor` is ``ampdoctor run``'s ``Doctor`` attached for as long as the
extension is loaded: it finds models, optimizers and GradScalers through torch's global hooks in whichever cell
builds them. IPython is imported by nobody here: the shell is what IPython hands ``load_ipython_extension``.

Do no harm: the callbacks and the magic go through ``call_safely``; an error of ampdoctor's is reported once
(AMP001) and never reaches the user's cell.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from ampdoctor.core.isolation import call_safely
from ampdoctor.core.report import Report, ReportView
from ampdoctor.runner.doctor import Doctor

__all__ = ["NotebookDoctor", "load_ipython_extension", "unload_ipython_extension"]

MAGIC = "ampdoctor"
USAGE = "usage: %ampdoctor [--fix | fix on]   (the findings and the watch summary so far; --fix: repairs on)"

_loaded: dict[int, "NotebookDoctor"] = {}   # by id(shell): the one doctor of each IPython shell


class NotebookDoctor:
    """``ampdoctor run``'s `Doctor`, attached to an IPython shell between ``%load_ext`` and ``%unload_ext``.

    Args:
        shell: the ``InteractiveShell`` (what IPython passes ``load_ipython_extension``).
        fix: start with ``--fix``'s repairs on.
        console: the rich console to print to; by default plain text on the current ``sys.stdout``, under the
            cell's own output (in a kernel, under IPython's traceback).
    """

    def __init__(self, shell: Any, *, fix: bool = False, console: Any = None) -> None:
        self.shell = shell
        self.doctor = Doctor(fix=fix, on_event=self._say)
        self.earlier: list[Report] = []   # the reports of the doctors a switch to --fix ended
        self._console = console

    # ---- load / unload ----------------------------------------------------------------------------------------
    def load(self) -> "NotebookDoctor":
        self.doctor.attach()
        self.shell.events.register("post_run_cell", self.post_run_cell)
        self.shell.register_magic_function(self.magic, "line", MAGIC)
        return self

    def unload(self) -> Report:
        """Remove every hook, the callback and the magic; return the last report."""
        call_safely(self.shell.events.unregister, "post_run_cell", self.post_run_cell)
        call_safely(self._remove_magic)
        self.doctor.detach()
        return self.doctor.report

    def _remove_magic(self) -> None:
        line_magics = self.shell.magics_manager.magics["line"]
        if getattr(line_magics.get(MAGIC), "__self__", None) is self:
            del line_magics[MAGIC]

    # ---- a cell ended -----------------------------------------------------------------------------------------
    def post_run_cell(self, result: Any) -> None:
        """IPython's ``post_run_cell`` event: explain the cell's exception, after IPython printed its traceback."""
        exc = getattr(result, "error_in_exec", None)
        if exc is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        call_safely(self._explain, exc, on_error=self.doctor.session.internal_error)

    def _explain(self, exc: BaseException) -> None:
        report = self.doctor.report
        earlier = report.exception, report.extra.get("explained_by")
        report.exception = None   # the session keeps the first crash of a run; in a kernel each cell may raise one
        found = self.doctor.explain(exc)
        if not found:
            # A NameError or a typo is no mixed-precision problem: not recorded, and nothing is said about it.
            report.exception = earlier[0]
            report.extra["explained_by"] = earlier[1]
            if earlier[1] is None:
                report.extra.pop("explained_by")
            return
        self._print(ReportView(Report(findings=found), exception=False))

    # ---- the magic --------------------------------------------------------------------------------------------
    def magic(self, line: str = "") -> None:
        """``%ampdoctor``: show the findings and the watch summary so far; ``--fix`` / ``fix on``: repairs on."""
        words = shlex.split(line)
        if words in (["--fix"], ["fix", "on"]):
            call_safely(self.fix_on, on_error=self.doctor.session.internal_error)
        elif words:
            self._say(USAGE)
            return
        call_safely(self.show, on_error=self.doctor.session.internal_error)

    def fix_on(self) -> None:
        """Switch ``--fix``'s repairs on for the following cells: this doctor's run ends (its report is kept and
        shown with the next ones) and one with ``fix=True`` attaches, as ``ampdoctor run --fix`` would."""
        if self.doctor.fix:
            self._say("ampdoctor: --fix is already on")
            return
        self.doctor.detach()
        self.earlier.append(self.doctor.report)
        self.doctor = Doctor(fix=True, on_event=self._say).attach()
        self._say("ampdoctor: --fix is on for the following cells: trainable fp16/bf16 parameters are repaired "
                  "before their first update")

    def show(self) -> None:
        self._print(ReportView(self.snapshot(), watch=True))

    def snapshot(self) -> Report:
        """Return the report so far: the findings (pre-flight, crashes, the guard's and the watch's until now) and
        the watch's summary, without ending anything."""
        session = self.doctor.session
        report = Report(exception=session.report.exception, changes=list(session.report.changes),
                        extra=dict(session.report.extra))
        for finding in [f for r in self.earlier for f in r.findings] + session.report.findings:
            report.add(finding)
        if session.guard is not None:
            for finding in call_safely(session.guard.findings, on_error=session.internal_error) or []:
                report.add(finding)
        if session.watch is not None:
            for finding in call_safely(session.watch.findings, on_error=session.internal_error) or []:
                report.add(finding)
            summary = call_safely(session.watch.summary_data, on_error=session.internal_error)
            if summary is not None:
                report.extra["watch"] = summary
        report.observed = {kind: len(ids) for kind, ids in session.seen.items()}
        for earlier in self.earlier:
            for kind, count in (earlier.observed or {}).items():
                report.observed[kind] = report.observed.get(kind, 0) + count
        return report

    # ---- output -----------------------------------------------------------------------------------------------
    def _print(self, renderable: Any) -> None:
        console = self._console
        if console is None:
            from rich.console import Console

            # plain text into the cell's output, as the CLI writes off a terminal (no rich HTML inline yet)
            console = Console(file=sys.stdout, force_jupyter=False, highlight=False, soft_wrap=True)
        if isinstance(renderable, str):
            console.print(renderable, markup=False)
        else:   # a ReportView: drawn by ampdoctor.ui
            console.print(renderable)

    def _say(self, line: str) -> None:
        call_safely(self._print, line)


def load_ipython_extension(ipython: Any) -> None:
    """Attach ampdoctor to ``ipython`` (``%load_ext ampdoctor`` calls this; a second call does nothing)."""
    if id(ipython) not in _loaded:
        _loaded[id(ipython)] = NotebookDoctor(ipython).load()


def unload_ipython_extension(ipython: Any) -> None:
    """Remove every hook, callback and magic of ampdoctor from ``ipython`` (``%unload_ext ampdoctor``)."""
    notebook = _loaded.pop(id(ipython), None)
    if notebook is not None:
        report = notebook.unload()
        call_safely(notebook._print, ReportView(report, watch=True))
