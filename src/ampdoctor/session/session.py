"""The lifecycle of one run: pre-flight, fix, guard, watch, crash explanation and the end, written once.

Every entry point is a thin adapter over a `Session`: ``ampdoctor run``'s Doctor (``runner/doctor.py``) finds the
objects through torch's global hooks and hands them over; the Lightning and Trainer callbacks hand over what the
framework gives them. So whatever one entry point reports, the others report too.

1. ``observe_process()``: the pass-through observers of clipping and ``load_state_dict`` (``session.observers``).
2. ``start(setup)``: the pre-flight rules (plus an entry point's own checks), ``--fix``'s repairs when asked, the
   GradScaler guard and the watch. Called again for objects first seen later (a new fold, a resume, a second stage):
   new findings are added, the guard follows a new scaler, the watch keeps the model it follows.
3. The events of ``session.events`` while the loop runs; ``explain(exc)`` on a crash.
4. ``finish()``: the watch's and the guard's findings and numbers, the clip norms, the measured evidence, every hook
   removed, every reference to the user's objects dropped; returns the `Report`.

Do no harm: every step goes through ``call_safely``; an internal error is reported once as AMP001 (with its place)
and the session steps aside: its hooks return at once, and the training goes on as if nothing were attached.
"""

from __future__ import annotations

import time
import traceback
import weakref
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ampdoctor.core.findings import Finding
from ampdoctor.core.isolation import StepAside, call_safely
from ampdoctor.core.names import Names
from ampdoctor.core.options import RunOptions
from ampdoctor.core.records import Coverage
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup, owns_any, unwrap_optimizer
from ampdoctor.session.clip_norms import ClipNorms, clipping_finding
from ampdoctor.session.frameworks import hidden_losses
from ampdoctor.session.observers import GlobalObservers
from ampdoctor.session.repair import RunRepairs
from ampdoctor.session.run import INTERRUPT_STATUS, terminated
from ampdoctor.session.stages import Stages
from ampdoctor.session.watching import watch_coverage, watched_pair, watched_size

__all__ = ["Session"]

Checks = Callable[[TrainingSetup], list[Finding]]


class Session:
    """One run's lifecycle; see the module's description.

    Args:
        options: what the run was asked for (``core.options.RunOptions``): ``fix`` repairs what can be repaired
            before the first update (upcast trainable half parameters under autocast, fp32 master weights without
            it) and again after a downcast (``reapply``); ``watch``, ``every``, ``log_dir`` and ``activations`` set
            up the numerics watch.
        on_event: called with each human-readable event line (fixes applied, internal errors).
        stages: which objects the run trains now (``session.stages``; a notebook's doctors share what ended).

    >>> session = Session(RunOptions(watch=False))
    >>> model = nn.Linear(4, 4).half()
    >>> session.start(TrainingSetup(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    >>> session.finish().codes()
    ['AMP103']
    """

    def __init__(self, options: RunOptions = RunOptions(), *, on_event: Callable[[str], None] | None = None,
                 stages: Stages | None = None) -> None:
        self.options = options
        self.on_event = on_event or (lambda line: None)
        # the fixes say how this run asks for --fix (Report.add)
        self.report = Report(extra={"fix_command": options.fix_command} if options.fix_command else {})
        self.names = Names()   # how this run names what the script holds: every setup of the run uses it
        self.setup: TrainingSetup | None = None
        self.guard: Any = None
        self.watch: Any = None
        self.clip_label = "clip_grad_norm_"   # how AMP611 names the clipping (a framework names its own argument)
        self.failed_at: float | None = None   # when the run raised (time.time()), to order the ranks' crashes
        self.started = self.finished = False
        self.repairs = RunRepairs(self.report, self.on_event)
        self.observers = GlobalObservers(self, self.internal_error)
        self.parts = StepAside("ampdoctor", self.report.add, self._stepped_aside)
        self._handles: list[Any] = []
        self._clip_norms = ClipNorms()
        self._max_norm: Any = None
        self._coverage: Coverage | None = None   # which part of the models the watched optimizer steps
        self.stages = stages if stages is not None else Stages()   # which objects the run trains now
        # What the run trained, by identity, for the report's `observed` counts (kept after the end).
        self.seen: dict[str, set[int]] = {"models": set(), "optimizers": set(), "scalers": set()}
        self._unconfirmed: weakref.WeakSet = weakref.WeakSet()   # AMP301/302 said before a backward: wiring.py

    @property
    def broken(self) -> bool:
        """Whether an internal error made the session step aside."""
        return "run" in self.parts.off

    # ---- 1. the process-wide observers ------------------------------------------------------------------------
    def observe_process(self, scaler_classes: Sequence[type] = ()) -> None:
        """Install the pass-through observers of clipping and ``load_state_dict`` (also those of ``scaler_classes``:
        ``load_state_dict`` and ``__init__``). Before the script's first line, for ``ampdoctor run``: names it binds
        at import are then the observed ones."""
        self._handles += self.observers.attach(tuple(scaler_classes))

    def observe_frameworks(self) -> None:
        """Observe FSDP's own ``clip_grad_norm_`` and accelerate's ``Accelerator.clip_grad_norm_`` once they are
        imported (a no-op before, and the second time)."""
        self._handles += self.observers.attach_fsdp() + self.observers.attach_accelerate()

    def add_handle(self, handle: Any) -> None:
        """Keep ``handle`` (anything with ``remove()``) to remove it at the end, after the parts' own."""
        self._handles.append(handle)

    # ---- 2. the start: pre-flight, fix, guard, watch ----------------------------------------------------------
    def start(self, setup: TrainingSetup, parts: Sequence[nn.Module] | None = None,
              autocast: dict[int, torch.dtype | None] | None = None, *, checks: Checks | None = None,
              watch_model: nn.Module | None = None, watch_optimizers: Sequence[Any] | None = None,
              repair: bool = True, watch: bool = True) -> None:
        """Diagnose ``setup`` before its first update: pre-flight, fix, guard, watch.

        Args:
            setup: the run's objects (real optimizers; ``setup.models`` are the outermost models).
            parts: the modules seen running a forward (default: the models), for ``--fix``'s choice of repair.
            autocast: the autocast dtype each of ``parts`` runs under, by ``id`` (default: ``setup.autocast_dtype``).
            checks: an entry point's own checks of the setup, run with the rules (and again after a fix).
            watch_model: the model the watch follows (default: the one with the most entries it can summarise).
            watch_optimizers: the optimizers as the loop steps them (wrappers kept; default: ``setup.optimizers``).
            repair: whether ``fix`` may repair now: not where no model was seen running a forward pass (under which
                autocast it runs is unknown, so which repair fits is too).
            watch: whether to attach the watch now (not at the run's end: no step is left to watch).
        """
        if self.broken or self.finished:
            return
        self.started = True
        self.parts.guard("run", self._start, setup, list(parts or setup.models), autocast, checks, watch_model,
                         watch_optimizers, repair, watch)

    def _start(self, setup: TrainingSetup, parts: list[nn.Module], autocast: dict[int, torch.dtype | None] | None,
               checks: Checks | None, watch_model: nn.Module | None, watch_optimizers: Sequence[Any] | None,
               repair: bool = True, watch: bool = True) -> None:
        from ampdoctor.preflight.engine import run_preflight  # looked up at call time: tests inject faults there

        self.setup = setup
        self._note_setup(setup)
        self.observe_frameworks()   # FSDP and accelerate are imported by now if the script uses them

        def look() -> list[Finding]:
            return run_preflight(setup) + (checks(setup) if checks is not None else [])

        found = look()
        if self.options.fix and repair:
            dtypes = autocast if autocast is not None else {id(m): setup.autocast_dtype for m in parts}
            found = self.repairs.repair(setup, parts, dtypes, found, look,
                                        on_error=lambda exc: self.parts.fail("fix", exc))
        for finding in found:
            self.report.add(finding)
        if any(f.code in ("AMP301", "AMP302") for f in found):
            self._unconfirmed.update(unwrap_optimizer(o) for o in setup.optimizers)
        self.parts.guard("run", self._attach_guard)
        if self.options.watch and watch and self.watch is None:
            self.parts.guard("run", self._attach_watch, watch_model, watch_optimizers)

    def _note_setup(self, setup: TrainingSetup) -> None:
        self.seen["optimizers"].update(id(unwrap_optimizer(o)) for o in setup.optimizers)
        self.seen["models"].update(id(m) for m in setup.models)
        if setup.scaler is not None:
            self.seen["scalers"].add(id(setup.scaler))

    def _attach_guard(self) -> None:
        from ampdoctor.guard.scaler_guard import ScalerGuard

        setup = self.setup
        if setup is None or setup.scaler is None or not setup.scaler_enabled:
            return
        if self.guard is not None:
            if self.guard.scaler is setup.scaler:
                self.guard.setup = setup   # the same scaler over new models: name them from now on
                return
            self._collect_guard()   # a new scaler (a new fold or stage): keep what the old guard saw
            self.guard.detach()
        self.guard = ScalerGuard(setup.scaler, setup, observe_clipping=False, restore_facts=self.observers.facts)
        self.guard.attach()

    def _attach_watch(self, model: nn.Module | None, optimizers: Sequence[Any] | None) -> None:
        from ampdoctor.monitor.watcher import Watch  # looked up at call time: tests inject faults there

        setup = self.setup
        if setup is None or not setup.optimizers or not setup.models:
            return
        # the stage's objects: not those of the stages the watch left (a k-fold's earlier folds, which the setup
        # still holds), unless an optimizer of theirs steps on
        stage = self.stages.current(setup.optimizers)
        models = [m for m in setup.models if not self.stages.has_left() or any(owns_any(o, m) for o in stage)]
        candidates = [model] if model is not None else models
        model, optimizer = watched_pair(candidates, list(optimizers or stage))
        if any(p.is_meta for p in model.parameters()):
            return   # meta tensors hold no values: there are no numerics to watch (pre-flight still ran)
        options = self.options
        self.watch = Watch(model, optimizer, setup.scaler, every=options.every, log_dir=options.log_dir,
                           activations=options.activations, others=models, frozen=self.stages.frozen_models,
                           names=self.names, loss_scaler=setup.loss_scaler, audit=options.audit).attach()
        hidden_by = hidden_losses(setup.accelerator)
        if hidden_by is not None:   # the framework's log leaves NaN/inf losses out: check every one (AMP610)
            self.watch.count_every_loss(hidden_by)
        # the watch follows one optimizer
        self._coverage = watch_coverage(unwrap_optimizer(optimizer), setup, stage, models)
        self.stages.begin(stage)

    def optimizer_stepped(self, optimizer: Any) -> None:
        """Every optimizer step (O(1)): the watch follows the objects that train now. When optimizers diagnosed
        after the watched one step ``STAGE_AFTER`` times while it does not (a resume built a new model and
        optimizer, a second stage), the watch ends its stage and a new one follows the latest setup's
        (``session.stages``)."""
        watch, setup = self.watch, self.setup
        if watch is None or setup is None:
            return
        known = lambda: any(unwrap_optimizer(o) is optimizer for o in setup.optimizers)  # noqa: E731
        if self.stages.stepped(optimizer, watched=watch.follows(optimizer), known=known):
            self.parts.guard("run", self._next_stage, optimizer)

    def _next_stage(self, optimizer: Any) -> None:
        call_safely(self.watch.detach, on_error=self.internal_error)
        call_safely(self._collect_watch, on_error=self.internal_error)
        self.stages.end(self.setup.optimizers, self.report.extra.pop("watch", None))
        self.watch = None
        wrapped = [o for o in self.setup.optimizers if unwrap_optimizer(o) is optimizer]
        trained = [m for m in self.setup.models if owns_any(optimizer, m)]
        self._attach_watch(max(trained, key=watched_size) if trained else None,
                           wrapped + [o for o in self.setup.optimizers
                                      if o not in wrapped and not self.stages.left_behind(o)])

    def confirm_wiring(self, optimizer: Any) -> None:
        """At ``optimizer``'s first step, when the gradients exist: confirm or withdraw AMP301/AMP302 said earlier."""
        real = unwrap_optimizer(optimizer)
        if real not in self._unconfirmed or self.setup is None:
            return
        self._unconfirmed.discard(real)
        from ampdoctor.preflight.rules.wiring import confirm_wiring

        self.parts.guard("run", confirm_wiring, self.report, self.setup)

    def repair_before_wrap(self, setup: TrainingSetup, module: nn.Module, dtype: torch.dtype) -> None:
        """``--fix`` before ``DistributedDataParallel(module)`` builds its buckets for the parameters' dtypes (after
        that an upcast would break them): repair ``module``, which will run under ``dtype`` autocast, now."""
        from ampdoctor.preflight.engine import run_preflight

        def repair() -> None:
            self.repairs.repair(setup, [module], {id(module): dtype}, run_preflight(setup),
                                lambda: run_preflight(setup), on_error=lambda exc: self.parts.fail("fix", exc))

        self.parts.guard("run", repair)

    def reapply(self, setup: TrainingSetup, module: nn.Module, autocast: torch.dtype | None) -> None:
        """Under ``fix``: upcast again before this forward if the loop cast the model back to half."""
        if self.options.fix and "fix" not in self.parts.off:
            self.parts.guard("fix", self.repairs.reapply, setup, module, autocast)

    # ---- 3. the events of the loop (session.events.RunEvents) --------------------------------------------------
    def before_clip(self, parameters: Any, args: tuple, kwargs: dict, name: str = "clip_grad_norm_") -> None:
        # a clip by value returns no norm (ClipNorms records norms only)
        self._max_norm = None if name == "clip_grad_value_" else args[0] if args else kwargs.get("max_norm")
        if self.guard is not None:
            self.guard.clip_started(parameters, args, kwargs, name)

    def after_clip(self, result: Any, report_norm: bool = True) -> None:
        if self.guard is not None:
            self.guard.clip_finished(result)
        if report_norm:
            self._clip_norm(result)

    def wrapper_clipped(self, max_norm: Any, result: Any) -> None:
        self._max_norm = max_norm
        self._clip_norm(result)

    def _clip_norm(self, result: Any) -> None:
        scaled = self.guard is not None and self.guard.clipped_scaled
        if self.watch is not None:
            self.watch.note_clip(result, scaled=scaled)
        if not scaled:   # a norm of still-scaled gradients says nothing about the real one (AMP408 says so)
            self._clip_norms.record(self._max_norm, result)

    def optimizer_restored(self, optimizer: Any) -> None:
        if self.guard is not None:
            self.guard.state_restored()

    def scaler_restored(self, scaler: Any) -> None:
        if self.guard is not None:
            self.guard.state_restored()

    def scale_called(self, *args: Any, **kwargs: Any) -> None:
        """The guard attached during a ``scaler.scale()`` call, past its own observer: count that call."""
        if self.guard is not None:
            self.guard.adopt_scale_call(*args, **kwargs)

    # ---- a crash ----------------------------------------------------------------------------------------------
    def explain(self, exc: BaseException, setup: TrainingSetup | None = None) -> list[Finding]:
        """Record ``exc`` (the first crash reported wins) and its explanation from the catalog; return the findings.

        Args:
            exc: the exception that ended the run.
            setup: the objects to read (default: those of the last start); ``ampdoctor run`` reads the live ones
                again, since the crash may come from a model or optimizer built after the start.
        """
        if not self._record(exc):
            return []   # a framework may pass one crash on twice
        found = call_safely(self._explain, exc, setup or self.setup, on_error=self.internal_error) or []
        self.report.extra["explained_by"] = list(dict.fromkeys(f.code for f in found))   # []: not a known failure
        if not found:   # no rule knows it: keep what the run held at the crash, for the report to say
            self.report.exception["facts"] = call_safely(self._facts, exc, setup or self.setup) or []
        for finding in found:
            self.report.add(finding)
        return found

    def interrupted(self, exc: BaseException) -> None:
        """Record Ctrl-C (``exc``, a KeyboardInterrupt): the run was stopped, not broken; nothing to explain."""
        if self._record(exc):
            terminated(self.report, "Ctrl-C", INTERRUPT_STATUS)

    def not_started(self, exc: SyntaxError) -> None:
        """Record that the script could not be compiled (``exc``): nothing ran, so nothing was diagnosed."""
        if self._record(exc):
            self.report.extra["not_started"] = type(exc).__name__

    def _record(self, exc: BaseException) -> bool:
        """Record ``exc`` as the run's crash; return False where one is recorded already (the first wins)."""
        if self.report.exception is not None:
            return False
        self.failed_at = time.time()
        self.report.exception = {
            "type": type(exc).__name__,
            "message": str(exc)[:10_000],
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20_000:],
        }
        return True

    def _explain(self, exc: BaseException, setup: TrainingSetup | None) -> list[Finding]:
        from ampdoctor.explanations.crash import explain_exception  # looked up at call time (fault injection)

        return explain_exception(exc, setup, self.guard)

    def _facts(self, exc: BaseException, setup: TrainingSetup | None) -> list[str]:
        from ampdoctor.explanations.facts import crash_facts

        return crash_facts(exc, setup, getattr(self.guard, "scaler", None))

    # ---- 4. the end -------------------------------------------------------------------------------------------
    def snapshot(self) -> Report:
        """Return the report so far without ending anything: the findings (pre-flight, crashes, the guard's and the
        watch's until now) and the watch's summary (what ``%ampdoctor`` shows in a notebook)."""
        report = Report(exception=self.report.exception, changes=list(self.report.changes),
                        extra=dict(self.report.extra))
        for finding in self.report.findings:
            report.add(finding)
        if self.guard is not None:
            for finding in call_safely(self.guard.findings, on_error=self.internal_error) or []:
                report.add(finding)
        if self.watch is not None:
            for finding in call_safely(self.watch.findings, on_error=self.internal_error) or []:
                report.add(finding)
            summary = call_safely(self.watch.watch_summary, on_error=self.internal_error)
            if summary is not None:
                report.extra["watch"] = replace(summary, stages=tuple(self.stages.summaries))
        report.observed = {kind: len(ids) for kind, ids in self.seen.items()}
        return report

    def finish(self, checks: Callable[[], list[Finding]] | None = None) -> Report:
        """End the run: collect the watch's and the guard's findings and numbers (and ``checks()``), remove every
        hook, drop every reference to the user's objects, and return the report. A second call returns it again."""
        if self.finished:
            return self.report
        self.finished = True
        # The watch first: its final flush writes the last steps into the summary, the report and the log's end.
        if self.watch is not None:
            call_safely(self.watch.detach, on_error=self.internal_error)
            call_safely(self._collect_watch, on_error=self.internal_error)
        if self.guard is not None:
            call_safely(self._collect_guard, on_error=self.internal_error)
            call_safely(self.guard.detach, on_error=self.internal_error)
        call_safely(self.repairs.detach, on_error=self.internal_error)   # the master weights' hooks, then ours
        for handle in reversed(self._handles):
            call_safely(handle.remove, on_error=self.internal_error)
        self._handles = []
        call_safely(self._collect_clipping, on_error=self.internal_error)
        for finding in (call_safely(checks, on_error=self.internal_error) or []) if checks is not None else []:
            self.report.add(finding)
        self.guard = self.watch = self.setup = None
        self.report.observed = {kind: len(ids) for kind, ids in self.seen.items()}
        return self.report

    def _collect_watch(self) -> None:
        from ampdoctor.session.evidence import with_watch_evidence

        watched = self.watch.report()
        for finding in watched.findings:
            self.report.add(finding)
        summary = replace(watched.extra["watch"], coverage=self._coverage, stages=tuple(self.stages.summaries))
        self.report.extra["watch"] = summary
        # a prediction gets what the watch measured (AMP208)
        self.report.findings = [with_watch_evidence(f, summary) for f in self.report.findings]

    def _collect_guard(self) -> None:
        for finding in self.guard.findings():
            self.report.add(finding)

    def _collect_clipping(self) -> None:
        clipping = self._clip_norms.result()
        self._clip_norms.release()
        if clipping is not None:
            self.report.extra["clipping"] = clipping
            # A clip on some steps is ordinary (max_norm=1.0 on a fine-tune); one on every step hides how large the
            # gradients are: AMP611. Either way the norms before clipping are in report["clipping"].
            if clipping["clipped"] and clipping["clipped"] == clipping["calls"]:
                self.report.add(clipping_finding(clipping, self.clip_label))

    # ---- isolation --------------------------------------------------------------------------------------------
    def internal_error(self, exc: BaseException) -> None:
        """Report ampdoctor's own failure once (AMP001, with its place) and step aside; the training never sees it.

        Hooks stay registered until ``finish`` (they return at once): removing a hook while torch iterates over its
        hook dict (an optimizer step) would raise in the user's code.
        """
        self.parts.fail("run", exc)

    def _stepped_aside(self, part: str, exc: BaseException) -> None:
        what = "stepping aside, training continues unaffected" if part == "run" else \
            "--fix is off for the rest of the run, training continues unaffected"
        self.on_event(f"ampdoctor: internal error ({type(exc).__name__}: {exc}); {what}")
