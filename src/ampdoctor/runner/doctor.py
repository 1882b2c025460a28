"""The doctor: attach to a whole training process through torch's global hooks.

`Doctor` discovers the models (root modules run with grad enabled), optimizers and GradScalers of a process
without any change to the training code, runs the pre-flight rules once before the first update, attaches the
GradScaler guard and the numerics watch, applies fixes when asked, and explains a crash from the catalog.
"""

from __future__ import annotations

import sys
import time
import traceback
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ampdoctor._compat.accelerate import accelerator_built
from ampdoctor._torch.module_hooks import any_global_module_hook, silence_compile_hook_warning
from ampdoctor._torch.scaler import is_enabled
from ampdoctor.core.findings import Finding
from ampdoctor.core.isolation import call_safely, internal_error_finding
from ampdoctor.core.patch import observe
from ampdoctor.core.ranks import RankInfo, from_process_group
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup, unwrap_optimizer
from ampdoctor.runner.discovery import (instances, internal_optimizers, real_optimizers, scaler_classes, scan,
                                        trained_models, unwrap_module, watch_coverage, watched_size)
from ampdoctor.runner.frameworks import framework_autocast
from ampdoctor.runner.observers import GlobalObservers
from ampdoctor.runner.repair import RunRepairs, owns_any, split_repaired

_MAX_EARLY_SCANS = 3  # gc scans for optimizers from forward hooks before waiting for the first step
_MAX_SCANS = 64       # under --fix, scans for the optimizer of a model first seen after the start (folds)


class Doctor:
    """Watch a training process; a context manager.

    Args:
        fix: repair what can be repaired (upcast trainable params under autocast, fp32 master weights for a
            half model without autocast), and re-apply when the script downcasts again.
        watch: attach ``ampdoctor.watch`` to the trained model once it is known.
        every: sampling interval of the watch, in optimizer steps.
        log_dir: where the watch writes its JSON-lines flight recorder.
        activations: also run the activation monitor (first non-finite module, headroom).
        on_event: called with each human-readable event line (fixes applied, internal errors).

    >>> with Doctor(watch=False) as doctor:
    ...     pass
    >>> doctor.report.findings
    []
    """

    def __init__(self, *, fix: bool = False, watch: bool = True, every: int = 50, log_dir: str | None = None,
                 activations: bool = False, on_event: Callable[[str], None] | None = None,
                 on_rank: Callable[[RankInfo], None] | None = None) -> None:
        self.fix = fix
        self.watch_enabled = watch
        self.every = every
        self.log_dir = log_dir
        self.activations = activations
        self.on_event = on_event or (lambda line: None)
        self.on_rank = on_rank or (lambda info: None)   # told once, when this process's rank is first read
        self.report = Report()
        self.setup: TrainingSetup | None = None
        self.models: list[nn.Module] = []
        self._autocast: dict[int, torch.dtype | None] = {}
        self._depth = self._scans = 0
        self._handles: list[Any] = []
        self._forward_handles: list[Any] = []
        self._guard: Any = None
        self._watch: Any = None
        self._coverage: dict[str, Any] | None = None  # which part of the model the watched optimizer steps
        self.watch_summary: Any = None  # a rich renderable, once the watch has been detached
        self._repairs = RunRepairs(self.report, self.on_event)
        self._observers = GlobalObservers(self, self._internal_error)
        self._accelerator_found: Any = None
        self._broken = self._attached = False
        # What this process trained, by identity, for the report's `observed` counts (kept after detach).
        self._seen: dict[str, set[int]] = {"models": set(), "optimizers": set(), "scalers": set()}
        self._diagnosed: weakref.WeakSet = weakref.WeakSet()  # real optimizers the pre-flight has looked at
        self._internal: weakref.WeakSet = weakref.WeakSet()  # optimizers inside others' steps (ZeRO's own)
        self._unconfirmed: weakref.WeakSet = weakref.WeakSet()  # AMP301/302 said before a backward: see wiring.py
        # This process's rank, read from torch.distributed at the first look (the script may destroy its group
        # before the end); None outside a process group of several ranks.
        self.rank_info: RankInfo | None = None
        self.failed_at: float | None = None  # when the script raised (time.time()), to order the ranks' crashes

    # ---- attach / detach -------------------------------------------------------------------------------------
    def attach(self) -> "Doctor":
        if self._attached:
            return self
        self._attached = True
        # only ours: torch.compile would warn about them on every script (the filter goes when they go)
        quiet = [] if any_global_module_hook() else [silence_compile_hook_warning()]
        m = torch.nn.modules.module
        self._forward_handles = [
            m.register_module_forward_pre_hook(self._on_forward_pre),
            m.register_module_forward_hook(self._on_forward_post, always_call=True), *quiet]
        self._handles += [*self._forward_handles, register_optimizer_step_pre_hook(self._on_optimizer_step)]
        for cls in scaler_classes():
            if "scale" in vars(cls):
                self._handles.append(observe(cls, "scale", before=self._on_scale, on_error=self._internal_error))
        # Before the script's first line: names it binds at import (`from torch.nn.utils import clip_grad_norm_`)
        # are then the observed ones.
        self._handles += self._observers.attach(scaler_classes())
        if self.fix:
            self._handles.append(observe(torch.nn.parallel.DistributedDataParallel, "__init__",
                                         before=self._before_ddp, on_error=self._internal_error))
        return self

    def _before_ddp(self, ddp: Any, module: Any = None, *args: Any, **kwargs: Any) -> None:
        module = kwargs.get("module", module)
        if not self._broken and isinstance(module, nn.Module):
            self._repairs.before_ddp(module, _accelerator, self._observers.facts)

    def detach(self) -> None:
        # Reverse order of attachment: the watch's observers sit on top of the guard's on the same scaler.
        if self._watch is not None:
            # The final flush first: the summary, the report and the log's end line all include the last steps.
            self._safely(self._watch.detach)
            self._safely(self._collect_watch)
        if self._guard is not None:
            self._safely(self._collect_guard)
            self._safely(self._guard.detach)
        self._safely(self._repairs.detach)  # the master weights' hooks first, then ours
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        self._guard = self._watch = None
        # Keep the report; drop every reference to the user's objects.
        self.setup = None
        self.models = []
        self._autocast = {}
        self._attached = False
        self.report.observed = {kind: len(ids) for kind, ids in self._seen.items()}

    def __enter__(self) -> "Doctor":
        return self.attach()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            self.explain(exc)
        self.detach()

    # ---- discovery -------------------------------------------------------------------------------------------
    def _on_forward_pre(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth != 1 or self._broken or not torch.is_grad_enabled():
            return
        try:
            self._on_root_forward(module)
        except Exception as exc:  # never reach the user's forward
            self._internal_error(exc)

    def _on_forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _on_root_forward(self, module: nn.Module) -> None:
        first = next(module.parameters(), None)
        if first is None:
            return
        if all(m is not module for m in self.models):
            if not any(p.requires_grad for p in module.parameters()):
                return
            self.models.append(module)
            self._seen["models"].add(id(unwrap_module(module)))   # DDP(model), torch.compile(model): one model
        dtype = _autocast_dtype(first.device.type) or framework_autocast(module, self._framework_accelerator())
        self._autocast[id(module)] = dtype
        if self.setup is None and self._scans < _MAX_EARLY_SCANS:
            self._scans += 1
            if instances(torch.optim.Optimizer):
                self._start()
        elif self.fix and self.setup is not None and not self._repairs.knows(module) and self._scans < _MAX_SCANS:
            # A model not seen before (a new fold, a resumed copy): repair it before its backward, if an
            # optimizer trains it, so the GradScaler never sees its fp16 gradients.
            self._scans += 1
            if any(owns_any(o, module) for o in real_optimizers(instances(torch.optim.Optimizer))):
                self._start()
        if self.fix and self.setup is not None:
            self._repairs.reapply(self.setup, module, dtype)

    def _on_scale(self, scaler: Any, *args: Any, **kwargs: Any) -> None:
        self._seen["scalers"].add(id(scaler))
        if self.setup is None and not self._broken and self._attached:
            self._start(scaler)
            if self._guard is not None and self._guard.scaler is scaler:
                # The guard attached during this very scale() call, past its own observer: count the call.
                self._guard.adopt_scale_call(*args, **kwargs)

    def _framework_accelerator(self) -> Any:
        if self._accelerator_found is None and "accelerate" in sys.modules:
            self._accelerator_found = _accelerator() or False   # one scan; False: looked, none
        return self._accelerator_found or None

    # ---- process-wide events (GlobalObservers), forwarded to the guard --------------------------------------
    def before_clip(self, parameters: Any, args: tuple, kwargs: dict, name: str = "clip_grad_norm_") -> None:
        if self._guard is not None:
            self._guard.clip_started(parameters, args, kwargs, name)

    def after_clip(self, result: Any) -> None:
        if self._guard is not None:
            self._guard.clip_finished(result)
        if self._watch is not None:
            self._watch.note_clip(result, scaled=self._guard is not None and self._guard.clipped_scaled)

    def optimizer_restored(self, optimizer: Any) -> None:
        if self._guard is not None:
            self._guard.state_restored()

    def scaler_restored(self, scaler: Any) -> None:
        if self._guard is not None:
            self._guard.state_restored()

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        real = unwrap_optimizer(optimizer)
        if real in self._internal:
            return   # ZeRO's own per-rank optimizer, inside the step of the one the script calls
        self._seen["optimizers"].add(id(real))
        if real in self._unconfirmed and self.setup is not None:   # its first step: the gradients are there now
            self._unconfirmed.discard(real)
            self._safely(self._confirm_wiring)
        if self._broken or (self.setup is not None and real in self._diagnosed):
            return
        # The first step, or an optimizer never diagnosed: a new fold, a resume, a second stage.
        self._safely(self._start)

    # ---- the first look: pre-flight, fixes, guard, watch -------------------------------------------------------
    def _build_setup(self, scaler: Any = None) -> TrainingSetup:
        live = scan()
        models = trained_models(self.models, live.optimizers, live.modules)
        scalers = [scaler] if scaler is not None else live.scalers
        scaler = next((s for s in scalers if is_enabled(s)), scalers[0] if scalers else None)
        dtypes = [d for d in (self._autocast.get(id(m)) for m in self.models) if d is not None]
        return TrainingSetup(models, live.optimizers, scaler, dtypes[0] if dtypes else None, _accelerator(),
                             facts=self._observers.facts)

    def _start(self, scaler: Any = None) -> None:
        from ampdoctor.preflight.engine import run_preflight

        if not self.models:
            return
        first = self.setup is None
        self._read_rank()
        self.setup = self._build_setup(scaler)
        self._handles += self._observers.attach_fsdp()   # FSDP is imported by now if the script uses it
        self._diagnosed.update(self.setup.optimizers)
        self._internal.update(internal_optimizers(self.setup.optimizers))
        self._seen["optimizers"].update(id(unwrap_optimizer(o)) for o in self.setup.optimizers)
        self._seen["models"].update(id(m) for m in self.setup.models)   # also those not called yet (found by owner)
        if self.setup.scaler is not None:
            self._seen["scalers"].add(id(self.setup.scaler))
        found = run_preflight(self.setup)
        if self.fix:
            before = len(self.report.changes)
            self._repairs.apply(self.setup, self.models, self._autocast)   # all or nothing: it rolls back on error
            if len(self.report.changes) > before:
                # What the fix resolved stays in the report, as info that says so: the script still has the bug.
                found, fixed, line = split_repaired(found, run_preflight(self.setup), "--fix", "the script itself")
                if line:
                    self.report.extra["fixed"] = [f.to_dict() for f in fixed]
                    self.on_event(line)
        for finding in found:
            self.report.add(finding)
        if any(f.code in ("AMP301", "AMP302") for f in found):
            self._unconfirmed.update(unwrap_optimizer(o) for o in self.setup.optimizers)
        self._safely(self._attach_guard)
        if self.watch_enabled and self._watch is None:
            self._safely(self._attach_watch)
        if first and not self.fix:
            # Discovery is done: stop paying two Python calls per module call. (Safe inside a forward hook:
            # torch iterates over a copy of the global forward hooks.) --fix keeps them to re-apply after a downcast.
            for handle in self._forward_handles:
                handle.remove()

    def _confirm_wiring(self) -> None:
        from ampdoctor.preflight.rules.wiring import confirm_wiring

        confirm_wiring(self.report, self.setup)

    def _attach_guard(self) -> None:
        from ampdoctor.guard.scaler_guard import ScalerGuard

        setup = self.setup
        if setup is None or setup.scaler is None or not setup.scaler_enabled:
            return
        if self._guard is not None:
            if self._guard.scaler is setup.scaler:
                self._guard.setup = setup  # the same scaler over new models: name them from now on
                return
            self._collect_guard()  # a new scaler (a new fold or stage): keep what the old guard saw
            self._guard.detach()
        self._guard = ScalerGuard(setup.scaler, setup, observe_clipping=False, restore_facts=self._observers.facts)
        self._guard.attach()

    def _attach_watch(self) -> None:
        from ampdoctor.monitor.watcher import Watch

        setup = self.setup
        if setup is None or not setup.optimizers or not setup.models:
            return
        model = max(setup.models, key=watched_size)
        if any(p.is_meta for p in model.parameters()):
            return  # meta tensors hold no values: there are no numerics to watch (pre-flight still ran)
        optimizer = next((o for o in setup.optimizers if owns_any(o, model)), setup.optimizers[0])
        self._watch = Watch(model, optimizer, setup.scaler, every=self.every, log_dir=self.log_dir,
                            activations=self.activations, others=setup.models).attach()
        self._coverage = watch_coverage(optimizer, setup)   # the watch follows one optimizer: say what it covers

    def _collect_guard(self) -> None:
        for finding in self._guard.findings():
            self.report.add(finding)

    def _collect_watch(self) -> None:
        from ampdoctor.monitor.summary import render_watch

        watch_report = self._watch.report()
        if self._coverage is not None:
            watch_report.extra["watch"]["coverage"] = self._coverage
        self.watch_summary = render_watch(watch_report.extra["watch"], None)  # findings: in the report's one table
        for finding in watch_report.findings:
            self.report.add(finding)
        self.report.extra.update(watch_report.extra)
        from ampdoctor.runner.evidence import with_watch_evidence  # a prediction gets what the watch measured

        self.report.findings = [with_watch_evidence(f, watch_report.extra.get("watch")) for f in self.report.findings]

    def _read_rank(self) -> None:
        if self.rank_info is None:
            self.rank_info = from_process_group()
            if self.rank_info is not None:
                call_safely(self.on_rank, self.rank_info)

    # ---- crash explanation and isolation ---------------------------------------------------------------------
    def explain(self, exc: BaseException) -> list[Finding]:
        """Explain ``exc`` from the catalog, record it in the report and return the findings."""
        from ampdoctor.explanations.crash import explain_exception

        self.failed_at = time.time()
        self._read_rank()
        self.report.exception = {
            "type": type(exc).__name__,
            "message": str(exc)[:10_000],
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20_000:],
        }
        findings: list[Finding] = []
        try:
            # Read the live objects again: the crash may come from a model or optimizer built after the first
            # look (a new fold), and the guard's own setup still names the ones it watched.
            setup = self._build_setup() if self.models else self.setup
            findings = explain_exception(exc, setup, self._guard)
        except Exception as inner:
            self._internal_error(inner)
        for finding in findings:
            self.report.add(finding)
        return findings

    def _safely(self, fn: Callable[[], Any]) -> Any:
        return call_safely(fn, on_error=self._internal_error)

    def _internal_error(self, exc: BaseException) -> None:
        if not self._broken:
            self.report.add(internal_error_finding(exc))
            self.on_event(f"ampdoctor: internal error ({type(exc).__name__}: {exc}); stepping aside, "
                          "training continues unaffected")
        # Hooks stay registered until detach (they return at once when broken): removing a hook while torch
        # iterates over its hook dict (an optimizer step) would raise in the user's code.
        self._broken = True




def _autocast_dtype(device: str) -> torch.dtype | None:
    try:
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    except RuntimeError:  # a device type autocast does not know, e.g. "meta"
        return None



def _accelerator() -> Any:
    if not accelerator_built():   # one gc scan, only once an Accelerator was built
        return None
    found = [o for o in instances(object) if type(o).__name__ == "Accelerator"]
    return found[0] if found else None
