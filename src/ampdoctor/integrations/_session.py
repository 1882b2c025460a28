"""A framework callback's run: the `Session` given the real objects the framework hands the callback.

`CallbackSession` is the callback-side counterpart of ``ampdoctor.runner.doctor.Doctor``: the framework already
knows its model, its real optimizers and its GradScaler, so nothing is discovered through global hooks or the
garbage collector. The lifecycle (pre-flight, fix, guard, watch, explanation, the end) is the session's; this adapter
writes the JSON before the first step (so a crash at step 0 still leaves it) and after a crash, and ends with one
report: console, JSON and the flight recorder's last line. The console gets the findings once, at the end (after a
crash: with its explanation), as under ``ampdoctor run``. In a process that ``ampdoctor run``, ``attach()`` or the
notebook extension already diagnoses (``runner.attached.diagnosed_by``), that run shows the process's report: the
callback writes its JSON and its log, and shows none.

Do no harm: every step of it goes through ``call_safely``; an internal error is reported once as AMP001 and
ampdoctor steps aside, and the training continues as if no callback were attached.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ampdoctor.core.findings import Finding
from ampdoctor.core.io import write_atomic
from ampdoctor.core.isolation import call_safely
from ampdoctor.core.options import RunOptions
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup, unwrap_optimizer
from ampdoctor.core.views import printer
from ampdoctor.ranks.in_process import InProcessRanks
from ampdoctor.runner.attached import diagnosed_by
from ampdoctor.session.run import end_run, say_nothing, terminated
from ampdoctor.session.session import Session
from ampdoctor.session.termination import Termination

__all__ = ["CallbackSession"]


class CallbackSession:
    """One training run seen from a framework callback: a thin adapter over the run's `Session`.

    Args:
        options: what the callback was asked for (``core.options.RunOptions``): its ``json_path`` is written before
            the first step, after a crash and at the end; its ``log_dir`` gets the final report appended; ``fix``
            repairs trainable half parameters before the first step, as ``ampdoctor run --fix`` does.
        show: print the report to the console at the end (the main process only, in a distributed run; never
            where another run diagnoses the process).
        say: what prints the report and the lines (``core.views.printer``: stderr by default).
        main: whether the framework calls this process its main one. A process that is not, in a job whose rank
            cannot be read (no process group, no launcher's variables), writes no file: it would overwrite the
            main one's.

    In a job of several processes (found when it starts) every rank diagnoses its own replica and writes its own
    flight recorder; at the end rank 0 prints and writes the one report of the job (``InProcessRanks``).
    """

    def __init__(self, options: RunOptions, *, show: bool = True, say: Callable[[Any], None] | None = None,
                 main: bool = True) -> None:
        self.options = options
        self.show, self.main = show, main
        self.session = Session(options, on_event=self._event)
        self.report = self.session.report
        self._print = say or printer(stderr=True)
        self.ranks: InProcessRanks | None = None   # None: a single process
        self.outer: str | None = None   # what else diagnoses this process and shows its report (`ampdoctor run`)
        self._termination = Termination(self._terminated)

    @property
    def json_path(self) -> str | None:
        """Where this process writes the report (None: nowhere; a job's other ranks hand theirs to rank 0)."""
        return self.options.json_path

    @property
    def started(self) -> bool:
        return self.session.started

    @started.setter
    def started(self, value: bool) -> None:
        self.session.started = value

    @property
    def finished(self) -> bool:
        return self.session.finished

    @property
    def clip_label(self) -> str:
        return self.session.clip_label

    @clip_label.setter
    def clip_label(self, value: str) -> None:
        self.session.clip_label = value

    @property
    def failed_at(self) -> float | None:
        return self.session.failed_at

    # ---- the start: before the first step -------------------------------------------------------------------
    def start(self, model: nn.Module, optimizers: list[Any], scaler: Any, autocast_dtype: torch.dtype | None, *,
              accelerator: Any = None, findings: Callable[[TrainingSetup], list[Finding]] | None = None) -> None:
        """Pre-flight (plus the framework's own ``findings``), ``fix``, guard and watch; write the report's JSON.

        Args:
            model: the module the framework trains, named as the user knows it (the LightningModule,
                ``trainer.model``).
            optimizers: its optimizers, wrapped or not (each is diagnosed once, as the torch optimizer inside).
            scaler: the framework's GradScaler, if any.
            autocast_dtype: the dtype of the autocast the framework runs the forward under, None for none.
            accelerator: an ``accelerate.Accelerator``, if the framework uses one.
            findings: the framework's own checks, given the setup; run again after a fix like the rules.
        """
        if self.session.started:
            return
        call_safely(self._termination.install, on_error=self.internal_error)   # the end also happens on SIGTERM
        call_safely(self._find_ranks, on_error=self.internal_error)
        self.outer = call_safely(diagnosed_by, on_error=self.internal_error)
        real = list({id(o): o for o in map(unwrap_optimizer, optimizers)}.values())
        setup = call_safely(TrainingSetup, model, real, scaler, autocast_dtype, accelerator,
                            facts=self.session.observers.facts, names=self.session.names, on_error=self.internal_error)
        self.session.started = True
        if setup is not None:
            self.session.observe_process()   # clip_grad_norm_ and Optimizer.load_state_dict, as under `run`
            self.session.start(setup, [model], {id(model): autocast_dtype}, checks=findings, watch_model=model,
                               watch_optimizers=optimizers)
        # Shown once, at the end (finish); the JSON now, so a crash at step 0 still leaves it.
        call_safely(self.write, on_error=self.internal_error)

    def _find_ranks(self) -> None:
        # Before the watch starts: each rank's flight recorder needs its own file.
        self.ranks = InProcessRanks.detect(self._termination.stopped)
        if self.ranks is not None:
            self.session.options = self.options.replace(log_dir=self.ranks.log_dir(self.options.log_dir))
            self.show = self.show and self.ranks.rank == 0
        elif not self.main:   # the session's options too: it writes no flight recorder either
            self.options = self.session.options = self.options.replace(json_path=None, log_dir=None)

    # ---- a crash ----------------------------------------------------------------------------------------------
    def explain(self, exc: BaseException) -> None:
        """Record ``exc`` and its explanation from the catalog in the report, and rewrite the JSON."""
        self.session.explain(exc)
        call_safely(self.write, on_error=self.internal_error)

    # ---- the end ----------------------------------------------------------------------------------------------
    def finish(self, findings: Callable[[], list[Finding]] | None = None) -> Report:
        """End the session (``findings()``: the framework's own, at the end), then show and write the report; in a
        job of several processes rank 0 reports the job (``ampdoctor.session.run.end_run``)."""
        if self.session.finished or not self.session.started:
            return self.report
        with self._termination.closing():
            self.session.finish(findings)
            call_safely(self._end, on_error=self.internal_error)
        return self.report

    def _end(self) -> None:
        failed = int(self.report.exception is not None or bool(self.report.exit_status))
        shown = self.outer is None   # else the run that diagnoses the process shows its one report
        exchange = self.ranks.exchange if self.ranks is not None else None
        rank = self.ranks.info if self.ranks is not None else None
        end_run(self.report, self.options, exit_code=failed,
                failed_at=self.failed_at, say=self._print if shown else say_nothing, write=write_atomic,
                traceback="follows", show=self.show and shown, exchange=exchange, rank=rank)

    def _terminated(self) -> None:
        """A SIGTERM stopped the training: end the run now, as at its end (the report covers the steps so far)."""
        terminated(self.report)
        self.session.finish()
        self._end()

    # ---- output and isolation ---------------------------------------------------------------------------------
    def write(self) -> None:
        """Write the report's JSON to ``json_path`` (atomically: a crash mid-write leaves the previous one)."""
        path = self._json_path()
        if path is not None:   # in a job, the ranks other than 0 hand their report to rank 0 at the end instead
            write_atomic(path, self.report.to_json())

    def _json_path(self) -> str | None:
        return self.json_path if self.ranks is None else self.ranks.json_path(self.json_path)

    def _event(self, line: str) -> None:
        if self.show:
            call_safely(self._print, line)

    def internal_error(self, exc: BaseException) -> None:
        """Report ampdoctor's own failure once (AMP001) and carry on; the training never sees it."""
        self.session.internal_error(exc)


