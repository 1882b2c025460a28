"""``ampdoctor.attach()``: the diagnosis of ``ampdoctor run`` in a process that ampdoctor did not start.

One line at the top of a script, or of a Ray Train worker function, or ``AMPDOCTOR=1`` in the environment
(``runner/startup.py``), when the job must be started as ``python train.py`` by something else::

    import ampdoctor
    ampdoctor.attach()                        # the report is printed when the process exits
    with ampdoctor.attach(json_path="r.json"):   # ... or at the end of the block (a worker function)
        train()

From then on the process runs with ``ampdoctor run``'s `Doctor`: models, optimizers and GradScalers are found
through torch's global hooks, the pre-flight runs before the first update, then the guard and the watch. At the end
(the block's, `Attached.end`, or the process's: ``atexit``, also after an uncaught exception, explained under its
traceback) the report is shown on stderr, the JSON written and the flight recorder's last line appended, as
``ampdoctor run --json --log-dir`` does; in a job of several ranks rank 0 shows and writes the one report of the job
(``ranks.job.end_job``). The exit status is the script's own: ampdoctor never changes it; it reads it from the
uncaught exception or from ``sys.exit()`` (a bare ``raise SystemExit(n)`` is not seen).

Do no harm: every step goes through ``call_safely``; an error of ampdoctor's is reported once (AMP001) and never
reaches the training.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import sys
import traceback
from typing import Any, Callable, Iterator

from ampdoctor._compat.ray import in_train_worker
from ampdoctor.core.callsite import without_own_frames
from ampdoctor.core.io import write_atomic
from ampdoctor.core.isolation import call_safely
from ampdoctor.core.options import RunOptions
from ampdoctor.core.patch import observe
from ampdoctor.core.report import Report
from ampdoctor.core.usage import UsageError
from ampdoctor.core.views import printer
from ampdoctor.ranks.in_process import InProcessRanks
from ampdoctor.ranks.info import RankInfo
from ampdoctor.runner.doctor import Doctor
from ampdoctor.session.run import SIGTERM_STATUS, end_run, terminated
from ampdoctor.session.termination import Termination

ENV = "AMPDOCTOR"   # runner.startup.ENV; startup imports this module, so it is not imported from there
# Ray Train kills its workers after the fit (`ampdoctor._compat.ray`): an attach() there that is not a with block
# never reaches its atexit report. Said once, by rank 0, at the first look (a with block has been entered by then).
RAY_WORKER_LINE = "ampdoctor: no report at exit in Ray: wrap the loop in `with ampdoctor.attach():`"

__all__ = ["Attached", "attach", "chain_excepthook", "diagnosed_by", "watched_by"]

_active: list["Attached"] = []   # the one attached run of this process, while it runs
_watchers: list[str] = []        # what else diagnoses this process now: `ampdoctor run`, its child hook, a notebook


@contextlib.contextmanager
def watched_by(what: str) -> Iterator[None]:
    """While open, ``attach()`` does nothing and says so: ``what`` (``"ampdoctor run"``) diagnoses this process."""
    _watchers.append(what)
    try:
        yield
    finally:
        _watchers.remove(what)


def diagnosed_by() -> str | None:
    """Return what diagnoses this process now (``"ampdoctor run"``, the notebook extension, ``attach()``), or None.

    That run shows the process's one report; a framework callback that also runs in it shows none of its own.

    >>> diagnosed_by() is None
    True
    """
    if _watchers:
        return _watchers[-1]
    return "ampdoctor.attach()" if _active else None


def attach(*, fix: bool = False, watch: bool = True, every: int = 50, log_dir: str | os.PathLike[str] | None = None,
           json_path: str | os.PathLike[str] | None = None, activations: bool = False, audit: Any = "off",
           announce: str = "attach") -> "Attached":
    """Diagnose this process as ``ampdoctor run`` would, from now until it exits (or the ``with`` block ends).

    Args:
        fix: ``--fix``: repair trainable fp16/bf16 parameters before their first update (upcast under autocast,
            fp32 master weights without it).
        watch: attach the numerics watch (``--no-watch``: False).
        every: the watch's sampling interval, in optimizer steps (``--every``).
        log_dir: the watch's JSON-lines flight recorder folder (``--log-dir``).
        json_path: where the JSON report is written at the end (``--json``).
        activations: also watch activations (``--activations``).
        audit: the steps the numerics audit re-runs in fp32: ``"off"`` (the default), ``"auto"`` (``--audit``: the
            first sampled step, the first whole one and the one after the first anomaly), ``"all"``
            (``--audit-every``), or step numbers (``--audit-steps``).
        announce: ``"attach"`` for a call in the code; ``"environment"`` for ``AMPDOCTOR=...`` (then a process that
            trained nothing, a launcher or a DataLoader worker, says nothing).

    Returns:
        The `Attached` run, also a context manager; its ``report`` is complete after `Attached.end`.

    Raises:
        ampdoctor.core.usage.UsageError: (a ``ValueError``) for an output path that cannot be written, a bad
            ``every``, or a second ``attach()`` with other options while one is attached. Checked here, before the
            first step.
    """
    # the fixes say how this process asks for --fix: the environment's switch, or this call
    asks = (f"{ENV}=--fix python {shlex.join(sys.argv)}" if announce == "environment" and sys.argv
            else "ampdoctor.attach(fix=True)")
    options = RunOptions(fix=fix, watch=watch, every=every, log_dir=log_dir, json_path=json_path,
                         activations=activations, fix_command=asks, audit=audit)
    if _watchers:
        return Attached(options, watched_by=_watchers[-1])
    if _active:
        if _active[0].quiet_when_idle and announce != "environment":   # AMPDOCTOR=... attached first: it holds
            _active[0]._say(f"ampdoctor: the script's attach() joins the run {ENV}={os.environ.get(ENV)!r} "
                            "started; the environment's options apply")
            return _active[0]
        if _active[0].options != options:
            raise UsageError(f"ampdoctor is already attached in this process with {_active[0].options}; call .end() "
                             "on it first, or attach once, at the top of the script")
        return _active[0]
    options.check_outputs()
    return Attached(options, quiet_when_idle=announce == "environment").start()


class Attached:
    """A run of ``ampdoctor run``'s Doctor inside this process; see `attach`.

    Attributes:
        doctor: the `ampdoctor.runner.doctor.Doctor` that finds what the process trains.
        report: the report (complete once ended).
    """

    def __init__(self, options: RunOptions, *, quiet_when_idle: bool = False, watched_by: str | None = None,
                 say: Callable[[Any], None] | None = None) -> None:
        self.options = options
        self.watched_by = watched_by   # not None: something else diagnoses the process; this one does nothing
        self.quiet_when_idle = quiet_when_idle
        self.doctor = Doctor(options, on_event=self._say, on_rank=self._on_rank, on_first_look=self._on_first_look)
        self.report: Report = self.doctor.report
        self.ranks: InProcessRanks | None = None   # None: a single process (so far)
        self.ended = False
        self._in_block = False   # used as `with attach():`: it ends with the block
        self._print = say or printer(stderr=True)
        self._uncaught: BaseException | None = None
        self._exit_code = 0   # what the script passed to sys.exit(), which atexit does not tell
        self._exit_handle: Any = None
        self._restore_excepthook: Callable[[], None] = lambda: None
        self._termination = Termination(self._terminated)

    @property
    def json_path(self) -> str | None:
        """Where the JSON report is written at the end (``json_path=``)."""
        return self.options.json_path

    # ---- the start -------------------------------------------------------------------------------------------
    def start(self) -> "Attached":
        if self.watched_by is not None:
            return self
        _active.append(self)
        call_safely(self._termination.install)   # the end also happens on SIGTERM (a scheduler's preemption)
        self.ranks = call_safely(InProcessRanks.detect, self._termination.stopped, "attach")   # Ray: the group exists
        if self.ranks is not None:
            self.doctor.log_dir = self.ranks.log_dir(self.doctor.log_dir)
        self.doctor.attach()
        self._restore_excepthook = chain_excepthook(self._on_uncaught)
        self._exit_handle = call_safely(observe, sys, "exit", before=self._on_exit)
        atexit.register(self._at_exit)
        return self

    def _on_rank(self, info: RankInfo) -> None:
        """The Doctor read this process's rank at its first look: a group made after ``attach()``."""
        if self.ranks is None:
            self.ranks = InProcessRanks.detect(self._termination.stopped, "attach")
            if self.ranks is not None:   # before the watch starts: each rank's flight recorder has its own file
                self.doctor.log_dir = self.ranks.log_dir(self.doctor.log_dir)

    def _on_first_look(self) -> None:
        if not self._in_block and in_train_worker():
            self._say(RAY_WORKER_LINE)

    # ---- a crash, or sys.exit() ------------------------------------------------------------------------------
    def _on_exit(self, code: Any = None) -> None:
        self._exit_code = _exit_status(SystemExit(code))

    def _on_uncaught(self, exc: BaseException) -> None:
        self._uncaught = exc
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            self.doctor.explain(exc)

    # ---- the end ----------------------------------------------------------------------------------------------
    def end(self) -> Report:
        """End the run now: every hook removed, the report shown, the JSON and the log's last line written; return
        the report. A second call returns it again."""
        return self._end(0, "above")

    def __enter__(self) -> "Attached":
        self._in_block = True
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        failed = exc is not None and not isinstance(exc, SystemExit)
        if failed and not isinstance(exc, KeyboardInterrupt):
            call_safely(self.doctor.explain, exc)
        status = 130 if isinstance(exc, KeyboardInterrupt) else 1 if failed else _exit_status(exc)
        self._end(status, "follows")   # the exception goes on, and its traceback is printed after the report
        if exc is not None and tb is not None:   # it goes on with the user's frames and torch's, not ours
            shown = call_safely(without_own_frames, tb, tb.tb_frame.f_code.co_filename)
            if shown is not None:
                exc.with_traceback(shown)

    def _at_exit(self) -> None:
        exc = self._uncaught
        self._end(130 if isinstance(exc, KeyboardInterrupt) else 1 if exc is not None else self._exit_code, "above")

    def _end(self, exit_code: int, where: str) -> Report:
        if self.ended or self.watched_by is not None:   # under `ampdoctor run`, its report is the run's
            self.ended = True
            return self.report
        self.ended = True
        if self in _active:
            _active.remove(self)
        call_safely(atexit.unregister, self._at_exit)
        call_safely(self._restore_excepthook)
        if self._exit_handle is not None:
            call_safely(self._exit_handle.remove)
        with self._termination.closing():
            self.doctor.detach()
            self.report = self.doctor.report
            self.report.exit_status = exit_code or self.report.exit_status
            call_safely(self._report, exit_code, where, on_error=self._failed_end)
        return self.report

    def _report(self, exit_code: int, where: str) -> None:
        report = self.report
        if self.quiet_when_idle and report.saw_nothing and not report.findings:
            # AMPDOCTOR=1 reached a process that trains nothing (torchrun's agent, a DataLoader worker): silent, also
            # when it fails (the agent raises ChildFailedError after its workers' reports) and nothing is written
            return
        exchange = self.ranks.exchange if self.ranks is not None else None
        rank = self.ranks.info if self.ranks is not None else self.doctor.rank_info
        end_run(report, self.options, exit_code=exit_code, failed_at=self.doctor.failed_at, say=self._print,
                write=write_atomic, traceback=where, exchange=exchange, rank=rank)

    def _failed_end(self, exc: BaseException) -> None:
        """ampdoctor's own failure while ending the run: said in a line, the script's exit is left alone."""
        self._say(f"ampdoctor: internal error while ending the run ({type(exc).__name__}: {exc}); the report may be "
                  "incomplete")

    def _terminated(self) -> None:
        """A SIGTERM stopped the process while it trained: end the run now (the report covers the steps so far)."""
        terminated(self.report)
        self._end(SIGTERM_STATUS, "above")

    # ---- output ---------------------------------------------------------------------------------------------
    def _say(self, line: str) -> None:
        if self.ranks is None or self.ranks.rank == 0:   # rank 0 speaks for the job
            call_safely(self._print, line)


def chain_excepthook(on_exception: Callable[[BaseException], Any]) -> Callable[[], None]:
    """Put a hook in front of ``sys.excepthook`` that calls ``on_exception(exc)`` for an uncaught exception, then
    prints it as Python would (through the hook that was there, or without ampdoctor's frames); return what
    removes it again (only while it is still the first)."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        call_safely(on_exception, exc)
        if previous is sys.__excepthook__:   # print as `python script.py` would, without ampdoctor's frames
            shown = call_safely(without_own_frames, tb, sys.argv[0] if sys.argv else "") or tb
            traceback.print_exception(kind, exc, shown)
        else:
            previous(kind, exc, tb)

    sys.excepthook = excepthook

    def restore() -> None:
        if sys.excepthook is excepthook:
            sys.excepthook = previous

    return restore


def _exit_status(exc: BaseException | None) -> int:
    code = getattr(exc, "code", None)
    return code if isinstance(code, int) else 0 if code is None else 1
