"""What every framework callback does, given the real objects the framework hands it.

`CallbackSession` is the callback-side counterpart of ``ampdoctor.runner.doctor.Doctor``: the framework already
knows its model, its real optimizers and its GradScaler, so nothing is discovered through global hooks or the
garbage collector. It runs the pre-flight rules before the first step (and writes the JSON then, so a crash at
step 0 still leaves it), applies ``fix`` when asked, attaches the GradScaler guard and the numerics watch, explains
an exception from the catalog, and ends with one report: console, JSON and the flight recorder's last line.

Do no harm: every step of it goes through ``call_safely``; an internal error is reported once as AMP001 and
ampdoctor steps aside, and the training continues as if no callback were attached.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

import torch
from torch import nn

from ampdoctor.core.findings import Finding
from ampdoctor.core.isolation import call_safely, internal_error_finding
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup, unwrap_optimizer
from ampdoctor.integrations._clip_norms import ClipNorms
from ampdoctor.integrations._ranks import CallbackRanks, write_text
from ampdoctor.integrations._rules import CLIPPED, integration_finding
from ampdoctor.runner.observers import GlobalObservers
from ampdoctor.runner.repair import RunRepairs, owns_any, split_repaired

__all__ = ["CallbackSession", "check_options"]


def check_options(json_path: Any, log_dir: Any, every: Any) -> None:
    """Refuse bad callback arguments when the callback is built, not at the end of a long run."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int, got {every!r}; every=1 looks at every step")
    for name, value in (("json_path", json_path), ("log_dir", log_dir)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"{name} must be a path (str or os.PathLike) or None, got {type(value).__name__}: "
                            f"{value!r:.80}")
    if json_path is not None and os.path.isdir(json_path):
        raise ValueError(f"json_path={str(json_path)!r} is a directory; pass a file path such as 'ampdoctor.json'")


class CallbackSession:
    """One training run seen from a framework callback.

    Args:
        json_path: where to write the report (before the first step, after a crash, at the end); None: nowhere.
        log_dir: the watch's flight recorder directory (or ``.jsonl`` file); the final report is appended to it.
        every: the watch's sampling interval, in optimizer steps.
        activations: also run the activation monitor.
        fix: repair trainable half parameters before the first step (upcast under autocast, fp32 master weights
            without it), as ``ampdoctor run --fix`` does.
        show: print the report to the console (the main process only, in a distributed run).
        console: the rich console to print to; stderr by default.
        main: whether the framework calls this process its main one. A process that is not, in a job whose rank
            cannot be read (no process group, no launcher's variables), writes no file: it would overwrite the
            main one's.

    In a job of several processes (found when it starts) every rank diagnoses its own replica and writes its own
    flight recorder; at the end rank 0 prints and writes the one report of the job (``CallbackRanks``).
    """

    def __init__(self, *, json_path: Any = None, log_dir: Any = None, every: int = 50, activations: bool = False,
                 fix: bool = False, show: bool = True, console: Any = None, main: bool = True) -> None:
        self.json_path = None if json_path is None else os.fspath(json_path)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.every, self.activations, self.fix, self.show, self.main = every, activations, fix, show, main
        self.report = Report()
        self.setup: TrainingSetup | None = None
        self.clip_label = "clip_grad_norm_"
        self.watch_summary: Any = None
        self._console = console
        self._guard: Any = None
        self._watch: Any = None
        self._handles: list[Any] = []
        self._observers: GlobalObservers | None = None
        self._repairs = RunRepairs(self.report, self._event)
        self._clip_norms = ClipNorms()
        self._max_norm: Any = None
        self._broken = False
        self.started = self.finished = False
        self.ranks: CallbackRanks | None = None   # None: a single process
        self.failed_at: float | None = None       # when the crash was explained (the job's first crash wins)

    # ---- the start: before the first step -------------------------------------------------------------------
    def start(self, model: nn.Module, optimizers: list[Any], scaler: Any, autocast_dtype: torch.dtype | None, *,
              accelerator: Any = None, findings: Callable[[TrainingSetup], list[Finding]] | None = None) -> None:
        """Pre-flight (plus the framework's own ``findings``), ``fix``, guard and watch; write and show the report.

        Args:
            model: the module the framework trains, named as the user knows it (the LightningModule,
                ``trainer.model``).
            optimizers: its optimizers, wrapped or not (each is diagnosed once, as the torch optimizer inside).
            scaler: the framework's GradScaler, if any.
            autocast_dtype: the dtype of the autocast the framework runs the forward under, None for none.
            accelerator: an ``accelerate.Accelerator``, if the framework uses one.
            findings: the framework's own checks, given the setup; run again after a fix like the rules.
        """
        if self.started:
            return
        self.started = True
        call_safely(self._find_ranks, on_error=self.internal_error)
        call_safely(self._start, model, optimizers, scaler, autocast_dtype, accelerator, findings,
                    on_error=self.internal_error)
        call_safely(self.write, on_error=self.internal_error)
        if self.show:
            call_safely(self._print, self.report, on_error=self.internal_error)

    def _find_ranks(self) -> None:
        # Before the watch starts: each rank's flight recorder needs its own file.
        self.ranks = CallbackRanks.detect()
        if self.ranks is not None:
            self.log_dir = self.ranks.log_dir(self.log_dir)
            self.show = self.show and self.ranks.rank == 0
        elif not self.main:
            self.json_path = self.log_dir = None

    def _start(self, model: nn.Module, optimizers: list[Any], scaler: Any, autocast_dtype: torch.dtype | None,
               accelerator: Any, findings: Callable[[TrainingSetup], list[Finding]] | None) -> None:
        from ampdoctor.preflight.engine import run_preflight

        real = list({id(o): o for o in map(unwrap_optimizer, optimizers)}.values())
        self._observers = GlobalObservers(self, self.internal_error)   # clipping and resumes, as under `run`
        setup = TrainingSetup(model, real, scaler, autocast_dtype, accelerator, facts=self._observers.facts)
        self.setup = setup
        self.report.observed = {"models": 1, "optimizers": len(real),
                                "scalers": int(scaler is not None)}

        def look() -> list[Finding]:
            return run_preflight(setup) + (findings(setup) if findings is not None else [])

        found = look()
        if self.fix:
            found = self._repair(setup, model, autocast_dtype, found, look)
        for finding in found:
            self.report.add(finding)
        self._handles += self._observers.attach(())   # clip_grad_norm_ and Optimizer.load_state_dict
        call_safely(self._attach_guard, on_error=self.internal_error)
        call_safely(self._attach_watch, optimizers, on_error=self.internal_error)

    def _repair(self, setup: TrainingSetup, model: nn.Module, autocast_dtype: torch.dtype | None,
                found: list[Finding], look: Callable[[], list[Finding]]) -> list[Finding]:
        before = len(self.report.changes)
        try:
            self._repairs.apply(setup, [model], {id(model): autocast_dtype})
        except Exception:
            return found   # all or nothing: it rolled back, and said so; the findings stand as they are
        if len(self.report.changes) == before:
            return found
        # What the fix resolved stays in the report, as info that says so: the training code still has it.
        found, fixed, line = split_repaired(found, look(), "fix=True", "the training code itself")
        if line:
            self.report.extra["fixed"] = [f.to_dict() for f in fixed]
            self._event(line)
        return found

    def _attach_guard(self) -> None:
        from ampdoctor.guard.scaler_guard import ScalerGuard

        setup = self.setup
        if setup is None or setup.scaler is None or not setup.scaler_enabled:
            return
        self._guard = ScalerGuard(setup.scaler, setup, observe_clipping=False, restore_facts=self._observers.facts)
        self._guard.attach()

    def _attach_watch(self, optimizers: list[Any]) -> None:
        from ampdoctor.monitor.watcher import watch

        setup = self.setup
        if setup is None or not setup.optimizers or not setup.models:
            return
        model = setup.models[0]
        if any(p.is_meta for p in model.parameters()):
            return   # meta tensors hold no values: there are no numerics to watch (pre-flight still ran)
        # The optimizer as the framework steps it (accelerate's wrapper skips steps itself); the watch sees through.
        optimizer = next((o for o in optimizers if owns_any(unwrap_optimizer(o), model)), optimizers[0])
        self._watch = watch(model, optimizer, setup.scaler, every=self.every, log_dir=self.log_dir,
                            activations=self.activations)

    # ---- events of the process-wide observers (GlobalObservers' sink) -----------------------------------------
    def before_clip(self, parameters: Any, args: tuple, kwargs: dict, name: str = "clip_grad_norm_") -> None:
        # a clip by value returns no norm (ClipNorms records norms only)
        self._max_norm = None if name == "clip_grad_value_" else args[0] if args else kwargs.get("max_norm")
        if self._guard is not None:
            self._guard.clip_started(parameters, args, kwargs, name)

    def after_clip(self, result: Any) -> None:
        if self._guard is not None:
            self._guard.clip_finished(result)
        scaled = self._guard is not None and self._guard.clipped_scaled
        if self._watch is not None:
            self._watch.note_clip(result, scaled=scaled)
        if not scaled:   # a norm of still-scaled gradients says nothing about the real one (AMP408 says so)
            self._clip_norms.record(self._max_norm, result)

    def optimizer_restored(self, optimizer: Any) -> None:
        if self._guard is not None:
            self._guard.state_restored()

    def scaler_restored(self, scaler: Any) -> None:
        if self._guard is not None:
            self._guard.state_restored()

    # ---- a crash ----------------------------------------------------------------------------------------------
    def explain(self, exc: BaseException) -> None:
        """Record ``exc`` and its explanation from the catalog in the report, and rewrite the JSON."""
        call_safely(self._explain, exc, on_error=self.internal_error)
        call_safely(self.write, on_error=self.internal_error)

    def _explain(self, exc: BaseException) -> None:
        from ampdoctor.explanations.crash import explain_exception

        if self.report.exception is not None:
            return   # the first report of a crash wins (a framework may pass it on twice)
        self.failed_at = time.time()
        self.report.exception = {
            "type": type(exc).__name__,
            "message": str(exc)[:10_000],
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20_000:],
        }
        found = explain_exception(exc, self.setup, self._guard)
        self.report.extra["explained_by"] = list(dict.fromkeys(f.code for f in found))   # [] : not a known failure
        for finding in found:
            self.report.add(finding)

    # ---- the end ----------------------------------------------------------------------------------------------
    def finish(self, findings: Callable[[], list[Finding]] | None = None) -> Report:
        """Detach everything, add the watch's and the guard's findings (and ``findings()``), write and show."""
        if self.finished or not self.started:
            return self.report
        self.finished = True
        if self._watch is not None:
            call_safely(self._watch.detach, on_error=self.internal_error)   # the final flush first
            call_safely(self._collect_watch, on_error=self.internal_error)
        if self._guard is not None:
            call_safely(self._collect_guard, on_error=self.internal_error)
            call_safely(self._guard.detach, on_error=self.internal_error)
        call_safely(self._repairs.detach, on_error=self.internal_error)
        for handle in reversed(self._handles):
            call_safely(handle.remove, on_error=self.internal_error)
        self._handles = []
        call_safely(self._collect_clipping, on_error=self.internal_error)
        if findings is not None:
            for finding in call_safely(findings, on_error=self.internal_error) or []:
                self.report.add(finding)
        self._guard = self._watch = self.setup = None   # drop every reference to the user's objects
        if self.ranks is None:
            call_safely(self.write, on_error=self.internal_error)
        log_path = (self.report.extra.get("watch") or {}).get("log_path")
        if log_path:   # each rank's own log ends with its own report
            from ampdoctor.monitor.recorder import append_report

            call_safely(append_report, log_path, self.report.to_dict(), on_error=self.internal_error)
        if self.ranks is not None:   # rank 0 reports the job; a crashed rank itself where rank 0 could not
            call_safely(self.ranks.end, self.report, self.failed_at, self.json_path, self.show, self._print,
                        write_text, self.watch_summary, on_error=self.internal_error)
        elif self.show:
            if self.watch_summary is not None and (self.report.extra.get("watch") or {}).get("steps"):
                call_safely(self._print, self.watch_summary, on_error=self.internal_error)
            call_safely(self._print, self.report, on_error=self.internal_error)
        return self.report

    def _collect_watch(self) -> None:
        self.watch_summary = self._watch.summary(findings=False)   # the findings go to the report's one table
        watch_report = self._watch.report()
        for finding in watch_report.findings:
            self.report.add(finding)
        self.report.extra.update(watch_report.extra)

    def _collect_guard(self) -> None:
        for finding in self._guard.findings():
            self.report.add(finding)

    def _collect_clipping(self) -> None:
        clipping = self._clip_norms.result()
        self._clip_norms.release()
        if clipping is None:
            return
        self.report.extra["clipping"] = clipping
        if clipping["clipped"]:
            nonfinite = (f"; {clipping['nonfinite']} were inf/NaN" if clipping["nonfinite"] else "")
            self.report.add(integration_finding(
                CLIPPED, self.clip_label,
                f"clip_grad_norm_(max_norm={clipping['max_norm']:g}) clipped {clipping['clipped']} of "
                f"{clipping['calls']} steps{nonfinite}; the pre-clip gradient norm reached {clipping['peak']:.4g} "
                f"(last {clipping['last']:.4g}). The optimizer and the watch's gradient statistics see the clipped "
                "gradients; these are the norms before clipping."))

    # ---- output and isolation ---------------------------------------------------------------------------------
    def write(self) -> None:
        """Write the report's JSON to ``json_path`` (atomically: a crash mid-write leaves the previous one)."""
        path = self.json_path if self.ranks is None else self.ranks.json_path(self.json_path)
        if path is None:
            return   # in a job, the ranks other than 0 hand their report to rank 0 at the end instead
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        partial = f"{path}.partial"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(self.report.to_json())
        os.replace(partial, path)

    def _print(self, renderable: Any) -> None:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True, highlight=False)
        if isinstance(renderable, str):
            self._console.print(renderable, markup=False, soft_wrap=True)
        else:
            self._console.print(renderable)

    def _event(self, line: str) -> None:
        if self.show:
            call_safely(self._print, line)

    def internal_error(self, exc: BaseException) -> None:
        """Report ampdoctor's own failure once (AMP001) and carry on; the training never sees it."""
        if not self._broken:
            self.report.add(internal_error_finding(exc))
            self._event(f"ampdoctor: internal error ({type(exc).__name__}: {exc}); stepping aside, training "
                        "continues unaffected")
        self._broken = True
