"""The IPython extension: ``%load_ext ampdoctor`` gives a notebook's kernel the diagnosis of ``ampdoctor run``.

In Jupyter, JupyterLab, Colab, Kaggle or a terminal IPython::

    %load_ext ampdoctor      # from now on: pre-flight, guard and watch of whatever the cells train
    ...                      # a cell that raises gets the crash explanation under its traceback
    %ampdoctor               # the findings and the watch's summary so far
    %ampdoctor --html        # the HTML report of the run so far, inline
    %ampdoctor --fix         # repairs on for the following cells (also: %ampdoctor fix on)
    %unload_ext ampdoctor    # every hook removed, as at the end of ``ampdoctor run``

The kernel is one long process, so a `NotebookDoctor` is ``ampdoctor run``'s ``Doctor`` attached for as long as the
extension is loaded: it finds models, optimizers and GradScalers through torch's global hooks in whichever cell
builds them. Re-running the cell that builds the model and optimizer is a new stage: the watch follows the new
objects from their first step, and a finding already reported is not reported again. ``%ampdoctor`` reports what the
kernel trains now; the findings of an earlier stage that the current one has not shown again (the crashed cell's,
now fixed) follow it under their own heading, not counted with the current ones. While the extension is loaded
``ampdoctor.attach()`` in a cell does nothing (one diagnosis per process). In a kernel the output is rich's (HTML
with a plain-text part); in a terminal IPython, plain text. IPython itself is imported only in a kernel, for
``--html``'s inline page.

Do no harm: the callbacks and the magic go through ``call_safely``; an error of ampdoctor's is reported once
(AMP001) and never reaches the user's cell.
"""

from __future__ import annotations

import shlex
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from ampdoctor.core.findings import Finding
from ampdoctor.core.grouping import group_findings
from ampdoctor.core.io import write_atomic
from ampdoctor.core.isolation import call_safely
from ampdoctor.core.options import RunOptions
from ampdoctor.core.patch import observe
from ampdoctor.core.report import Report, ReportView
from ampdoctor.core.views import display_page, printer
from ampdoctor.core.words import counted
from ampdoctor.ranks.merge import merge_reports
from ampdoctor.runner.attached import watched_by
from ampdoctor.runner.doctor import Doctor
from ampdoctor.session.run import end_run
from ampdoctor.session.stages import Stages

__all__ = ["NotebookDoctor", "load_ipython_extension", "unload_ipython_extension"]

MAGIC = "ampdoctor"
USAGE = ("usage: %ampdoctor [--html | --fix | fix on]   (the findings and the watch summary so far; --html: the "
         "HTML report inline; --fix: repairs on)")

_loaded: dict[int, "NotebookDoctor"] = {}   # by id(shell): the one doctor of each IPython shell


@dataclass(frozen=True)
class _Stage:
    """A stage of the notebook's training: one doctor's run.

    Attributes:
        report: its doctor's report.
        trained: its pre-flight ran: it diagnosed what the cells trained (a doctor that saw nothing did not).
        ended_by: what ended it, as the words after "it ended when" (``"cell [2] raised"``); None while it runs.
    """

    report: Report
    trained: bool
    ended_by: str | None = None


class NotebookDoctor:
    """``ampdoctor run``'s `Doctor`, attached to an IPython shell between ``%load_ext`` and ``%unload_ext``.

    Args:
        shell: the ``InteractiveShell`` (what IPython passes ``load_ipython_extension``).
        fix: start with ``--fix``'s repairs on.
        say: what prints the lines and the reports (``core.views.printer``); by default rich's output in a kernel,
            plain text on the current ``sys.stdout`` in a terminal IPython, under the cell's own output (in a
            kernel, under IPython's traceback).
    """

    def __init__(self, shell: Any, *, fix: bool = False, say: Any = None) -> None:
        self.shell = shell
        # The optimizers and scalers of the stages a cell ended: the next stages' discovery leaves them out (a
        # crashed cell's traceback keeps them alive), until they train again (``session.stages``).
        self._ended: weakref.WeakSet = weakref.WeakSet()
        self.doctor = self._new_doctor(fix)
        self.earlier: list[_Stage] = []   # the stages a new stage or a switch to --fix ended, in order
        self._printer = say
        self._watched = watched_by("the notebook extension")
        self._built: weakref.WeakSet = weakref.WeakSet()   # the optimizers built since the last cell ended
        self._shown: set[tuple[str, str, str | None]] = set()   # the places of the findings explained under a cell
        self._handles: list[Any] = []

    def _new_doctor(self, fix: bool) -> Doctor:
        # a re-run cell's new optimizer: the watch follows it from its first step
        doctor = Doctor(RunOptions(fix=fix, fix_command="%ampdoctor --fix"), on_event=self._say,
                        stages=Stages(after=1, ended=self._ended))
        return doctor

    # ---- load / unload ----------------------------------------------------------------------------------------
    def load(self) -> "NotebookDoctor":
        import torch

        self._watched.__enter__()   # attach() in a cell does nothing while the extension is loaded
        self.doctor.attach()
        # Wherever a cell keeps its new optimizer (a name, a Trainer's attribute), building it is what a re-run does.
        self._handles = [observe(torch.optim.Optimizer, "__init__", after=self._optimizer_built,
                                 on_error=self._internal_error)]
        self.shell.events.register("post_run_cell", self.post_run_cell)
        self.shell.register_magic_function(self.magic, "line", MAGIC)
        return self

    def unload(self) -> Report:
        """Remove every hook, the callback and the magic; end the run as ``ampdoctor run`` does at the end of a
        script (``session.run.end_run``: the same words); return the last report."""
        call_safely(self.shell.events.unregister, "post_run_cell", self.post_run_cell)
        call_safely(self._remove_magic)
        for handle in self._handles:
            call_safely(handle.remove)
        self._handles = []
        self.doctor.detach()
        call_safely(self._watched.__exit__, None, None, None)
        report = self.doctor.report
        call_safely(end_run, report, self.doctor.session.options, exit_code=0, failed_at=None, say=self._print,
                    write=write_atomic, on_error=self._say_failure)
        return report

    def _say_failure(self, exc: BaseException) -> None:
        self._say(f"ampdoctor: internal error while ending the run ({type(exc).__name__}: {exc})")

    def _remove_magic(self) -> None:
        line_magics = self.shell.magics_manager.magics["line"]
        if getattr(line_magics.get(MAGIC), "__self__", None) is self:
            del line_magics[MAGIC]

    # ---- a cell ended -----------------------------------------------------------------------------------------
    def _optimizer_built(self, result: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self._built.add(optimizer)

    def _internal_error(self, exc: BaseException) -> None:
        self.doctor.session.internal_error(exc)   # the doctor of the current stage

    def post_run_cell(self, result: Any) -> None:
        """IPython's ``post_run_cell`` event: explain the cell's exception, after IPython printed its traceback;
        then, when the cell crashed or built new optimizers, the next cells are a new stage."""
        exc = getattr(result, "error_in_exec", None)
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            call_safely(self._explain, exc, on_error=self.doctor.session.internal_error)
        count = getattr(result, "execution_count", None)   # None for an empty cell
        cell = f"cell [{count}]" if isinstance(count, int) else "a cell"
        call_safely(self._stage_after_cell, exc is not None, cell, on_error=self.doctor.session.internal_error)

    def _stage_after_cell(self, crashed: bool, cell: str) -> None:
        """A notebook re-runs the cell that builds the model and optimizer: the objects of the cells before are
        gone, so this doctor's run ends (its report is kept, its findings are not repeated) and the next cells get
        a fresh one, which finds the new objects at their first step. So does a crash (the cell is fixed and re-run).
        The ended stage's optimizers and scalers are left out of the next stages' discovery until they train again:
        IPython keeps the crashed cell's traceback (``sys.last_traceback``), and its frames keep them alive."""
        seen = self.doctor.session.seen
        built, self._built = list(self._built), weakref.WeakSet()
        # new optimizers that have not trained yet (a cell that built and trained them is this stage's own)
        rebuilt = bool(built) and not any(id(o) in seen["optimizers"] for o in built)
        if (crashed or rebuilt) and any(seen.values()):
            self._ended.update(self.doctor.stages.objects())
            self._next_stage(f"{cell} raised" if crashed else f"{cell} built new optimizers", self.doctor.fix)

    def _next_stage(self, ended_by: str, fix: bool) -> None:
        """End this doctor's run (its report is kept, with what ended it) and attach a fresh one."""
        self.doctor.detach()
        self.earlier.append(_Stage(self.doctor.report, self.doctor.session.started, ended_by))
        self.doctor = self._new_doctor(fix).attach()

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
        new = [f for f in found if f.place not in self._shown]
        again = list(dict.fromkeys(f.code for f in found if f.place in self._shown))
        self._shown.update(f.place for f in new)
        if new:
            self._print(ReportView(Report(findings=new), exception=False))
        if again:   # a re-run cell raised the same: explained in full once, under the first traceback
            self._say(f"ampdoctor: {', '.join(again)} again, as explained above (%ampdoctor shows every finding)")

    # ---- the magic --------------------------------------------------------------------------------------------
    def magic(self, line: str = "") -> None:
        """``%ampdoctor``: show the findings and the watch summary so far; ``--html``: the HTML report inline;
        ``--fix`` / ``fix on``: repairs on."""
        words = shlex.split(line)
        if words == ["--html"]:
            call_safely(self.show_html, on_error=self.doctor.session.internal_error)
            return
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
        self._next_stage("--fix was switched on", fix=True)
        self._say("ampdoctor: --fix is on for the following cells: trainable fp16/bf16 parameters are repaired "
                  "before their first update")

    def show(self) -> None:
        current, earlier = self._stages_so_far()
        self._print(ReportView(current, exception=False, watch=True))   # a crash is explained in its cell
        self._show_earlier(earlier)

    def snapshot(self) -> Report:
        """Return the report of what the kernel trains now: that of the last stage that trained (`Session.snapshot`
        while it is the current doctor's), with the stages after it that saw nothing, and every stage's changes
        (a repair stays made). The earlier stages' findings are shown under it (`show`), not counted in it."""
        return self._stages_so_far()[0]

    def _stages_so_far(self) -> tuple[Report, list[tuple[_Stage, list[Finding]]]]:
        """Return the report of what the kernel trains now (`snapshot`) and, for each stage before it, the findings
        that no later stage shows again (each place once: the first stage that found it)."""
        now = _Stage(self.doctor.session.snapshot(), self.doctor.session.started)
        stages = [*self.earlier, now]
        # The stage the kernel trains now is the last that trained: a crash ends a stage, and the next cell may not
        # have trained yet (nothing to compare with: the crashed stage's findings are still current).
        live = max((i for i, stage in enumerate(stages) if stage.trained), default=len(stages) - 1)
        current = merge_reports([stage.report for stage in stages[live:]], main=0)
        current.changes = [c for stage in stages for c in stage.report.changes]
        # A finding the stage trained now has not shown again (its pre-flight looked at what trains now) is of an
        # earlier stage: kept visible under it, not counted with the current ones.
        shown = {f.place for f in current.findings}
        earlier = []
        for stage in stages[:live]:
            own = [f for f in stage.report.findings if f.place not in shown]
            shown.update(f.place for f in own)
            if own:
                earlier.append((stage, own))
        return current, earlier

    def _show_earlier(self, earlier: list[tuple[_Stage, list[Finding]]]) -> None:
        """Show the findings of the earlier stages, each stage's under a line that says so."""
        for stage, findings in earlier:
            rows = len(group_findings(findings))   # as the table shows them: one row per rule and cause
            self._say(f"ampdoctor: {counted(rows, 'finding')} of an earlier stage (it ended when {stage.ended_by}), "
                      f"not counted above: what the kernel trains now has not shown {'it' if rows == 1 else 'them'} "
                      "again")
            self._print(ReportView(Report(findings=findings), exception=False))

    def show_html(self) -> None:
        """``%ampdoctor --html``: the page ``ampdoctor report --html`` writes, of what the kernel trains now, inline,
        and the earlier stages' findings under it; a terminal IPython gets the plain report."""
        if not self._in_kernel():
            self.show()
            return
        current, earlier = self._stages_so_far()
        display_page(current)
        self._show_earlier(earlier)

    # ---- output -----------------------------------------------------------------------------------------------
    def _in_kernel(self) -> bool:
        return getattr(self.shell, "kernel", None) is not None   # ipykernel's shell has one; a terminal's does not

    def _print(self, item: Any) -> None:
        # rich's output in a kernel (HTML with a text part); plain text in a terminal, on its sys.stdout of now
        out = self._printer or (printer(stderr=False, kernel=True) if self._in_kernel() else
                                printer(stderr=False, file=sys.stdout))
        out(item)

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
        notebook.unload()
