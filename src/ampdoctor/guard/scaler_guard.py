"""Runtime guards for the GradScaler state machine: what the loop did, in which order, and why it failed.

``ScalerGuard`` observes ``scale``, ``unscale_``, ``step`` and ``update`` on one GradScaler instance, plus
``clip_grad_norm_`` and LR scheduler steps, with pass-through wrappers that detach exactly. Each observed call
costs O(1) Python and no host sync: found-inf flags stay on the device and are read in one batch when a finding
needs them. Parameters are only walked to explain a call that raised.
"""

from __future__ import annotations

import inspect
import os
import sys
import weakref
from collections import deque
from dataclasses import dataclass, field
from types import GeneratorType
from typing import Any, Iterable

import torch
import torch.nn.utils.clip_grad
from torch import nn
from torch.amp.grad_scaler import OptState
from torch.optim import lr_scheduler

from ampdoctor.core.callsite import user_call_site
from ampdoctor.core.patch import PatchHandle, observe
from ampdoctor.explanations.crash import (explain_exception, finding, fp16_culprits, no_grad_findings, optimizer_label,
                               with_scaler)
from ampdoctor.core.findings import Finding
from ampdoctor.core.training import TrainingSetup

__all__ = ["ScalerGuard"]

_HISTORY = 64          # closed iterations kept for explanations
_RESOLVE_EVERY = 32    # scheduler checks batched into one host sync
_PEEK = 64             # tensors of a clip_grad_norm_ argument looked at


@dataclass(eq=False)
class _Call:
    kind: str
    optimizer: Any
    site: str
    scale_calls: int                 # scale() calls earlier in the same iteration
    grad: tuple[weakref.ref, weakref.ref] | None = None   # (param, its .grad) at unscale_
    predicted: list[Finding] = field(default_factory=list)
    implicit: bool = False
    seq: int = 0                     # order among unscale_/step/clip calls


@dataclass(eq=False)
class _Iteration:
    """Everything observed between two ``update()`` calls."""

    index: int
    scale_calls: int = 0
    clips: int = 0
    unscaled: dict[int, _Call] = field(default_factory=dict)
    stepped: dict[int, _Call] = field(default_factory=dict)
    scheduler_steps: list[tuple[int, str, str]] = field(default_factory=list)   # (id(opt), class, site)
    found_inf: dict[int, list[torch.Tensor]] | None = None   # per optimizer, captured before update()
    last_clip: tuple[int, torch.Tensor] | None = None          # (call number, returned norm)
    flagged: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Seen:
    finding: Finding
    count: int = 1
    last: int | None = None


def _first_grad(optimizer: Any) -> tuple[weakref.ref, weakref.ref] | None:
    """Return weak references to the first parameter with a grad and that grad (bounded scan)."""
    n = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "grad", None) is not None:
                return weakref.ref(p), weakref.ref(p.grad)
            n += 1
            if n >= 16:
                return None
    return None


def _grads_reset(marker: tuple[weakref.ref, weakref.ref] | None) -> bool | None:
    """Return whether the grad seen at an earlier unscale_ was replaced since (zero_grad), None if unknown."""
    if marker is None:
        return None
    param = marker[0]()
    if param is None:
        return None
    return param.grad is None or param.grad is not marker[1]()


def _module_of(gen: GeneratorType, depth: int = 3) -> nn.Module | None:
    """Return the module behind ``model.parameters()`` (or a generator over it) without advancing it."""
    frame = gen.gi_frame
    if frame is None or depth == 0:
        return None
    owner = frame.f_locals.get("self")
    if isinstance(owner, nn.Module):
        return owner
    inner = frame.f_locals.get(".0")
    return _module_of(inner, depth - 1) if isinstance(inner, GeneratorType) else None


class ScalerGuard:
    """Watch a GradScaler's state machine and report misuse as findings.

    Args:
        scaler: the ``torch.amp.GradScaler`` to observe; its methods are wrapped on the instance only.
        setup: the training objects, for names and optimizer numbers.

    >>> model = nn.Linear(4, 4); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = torch.amp.GradScaler("cpu")
    >>> with ScalerGuard(scaler, TrainingSetup(model, opt)) as guard:
    ...     scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    ...     _ = nn.utils.clip_grad_norm_(model.parameters(), 1.0)     # still scaled
    ...     _ = scaler.step(opt); scaler.update()
    >>> [f.code for f in guard.findings()]
    ['AMP408']
    """

    def __init__(self, scaler: Any, setup: TrainingSetup | None = None) -> None:
        self.scaler = scaler
        self.setup = setup if setup is not None else TrainingSetup(scaler=scaler)
        self._handles: list[PatchHandle] = []
        self._broken = False
        self._cur = _Iteration(0)
        self._history: deque[_Iteration] = deque(maxlen=_HISTORY)
        self._seen: dict[tuple[str, str], _Seen] = {}
        self._crash: list[Finding] = []
        self._stack: list[_Call] = []
        self._expect_implicit: int | None = None
        self._optimizers: dict[int, weakref.ref] = {}
        self._last_stepped: dict[int, _Iteration] = {}
        self._pending: list[tuple[_Iteration, int, str, str]] = []
        self._param_ids: dict[int, tuple[int, frozenset[int]]] = {}
        self._module_owners: dict[int, frozenset[int]] = {}
        self._labels: dict[int, str] = {}
        self._known: list[Any] | None = None
        self._on = False
        self._calls = 0
        self._window_complete = False
        self._resume_checked = False

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def attach(self) -> "ScalerGuard":
        """Install the observers; a second call does nothing."""
        if self._handles or self._broken:
            return self
        s, err = self.scaler, self._on_error
        self._handles = [
            observe(s, "scale", before=self._before_scale, after=self._after_call, on_error=err),
            observe(s, "unscale_", before=self._before_unscale, after=self._after_call, on_error=err),
            observe(s, "step", before=self._before_step, after=self._after_step, on_error=err),
            observe(s, "update", before=self._before_update, after=self._after_update, on_error=err),
        ]
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            self._handles.append(observe(owner, "clip_grad_norm_", before=self._before_clip,
                                         after=self._after_clip, on_error=err))
        for cls in _scheduler_classes():
            self._handles.append(observe(cls, "step", before=self._before_scheduler, on_error=err))
        self._window_complete = getattr(s, "_scale", None) is None   # a fresh scaler: this iteration is whole
        self._on = bool(getattr(s, "_enabled", False))   # a disabled scaler's methods are no-ops
        return self

    def detach(self) -> None:
        """Remove every observer, restoring the original attributes exactly."""
        try:
            self._catch_up()
        finally:
            self._release()

    def _catch_up(self) -> None:
        """Commit a raised call and decide pending checks; an internal error becomes AMP001."""
        try:
            self._settle()
            self._resolve(force=True)
        except Exception as exc:  # never let the guard's own bookkeeping break the caller
            self._on_error(exc)

    def _release(self) -> None:
        self._on = False
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []

    def __enter__(self) -> "ScalerGuard":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ---- results --------------------------------------------------------------------------------------------

    @property
    def iteration(self) -> int:
        """The number of ``update()`` calls seen so far."""
        return getattr(self._cur, "index", 0)

    @property
    def broken(self) -> bool:
        """True once an internal error made the guard detach itself (reported as AMP001)."""
        return self._broken

    def findings(self) -> list[Finding]:
        """Return what went wrong so far; repeated findings are reported once with their count."""
        self._catch_up()
        out = []
        for seen in self._seen.values():
            f = seen.finding
            if seen.count > 1:
                f = Finding(f.code, f.severity, f.where,
                            f"{f.detail} (seen in {seen.count} iterations, {f.step} to {seen.last})", f.step)
            out.append(f)
        return out

    def crash_findings(self) -> list[Finding]:
        """Return the findings explaining the last observed scaler call that raised."""
        self._catch_up()
        return list(self._crash)

    def explain(self, exc: BaseException) -> list[Finding]:
        """Explain ``exc`` using this guard's history (see ``ampdoctor.explanations.crash.explain_exception``)."""
        return explain_exception(exc, self.setup, self)

    def skipped_iterations(self) -> list[int]:
        """Return the kept iterations whose optimizer step was skipped for inf/NaN gradients (one host sync)."""
        records = [r for r in self._history if r.found_inf]
        sums = _sum_flags([[t for ts in r.found_inf.values() for t in ts] for r in records])
        return [r.index for r, total in zip(records, sums) if total > 0]

    # ---- bookkeeping ----------------------------------------------------------------------------------------

    def _live(self) -> bool:
        return self._on

    def _label(self, optimizer: Any) -> str:
        label = self._labels.get(id(optimizer))
        if label is None:
            label = self._labels[id(optimizer)] = optimizer_label(optimizer, self.setup)
        return label

    def _record(self, f: Finding) -> None:
        key = (f.code, f.where)
        seen = self._seen.get(key)
        if seen is None:
            self._seen[key] = _Seen(f, 1, f.step)
        elif seen.last != f.step:
            seen.count += 1
            seen.last = f.step

    def _once(self, code: str, where: str, detail: str) -> None:
        """Record a silent finding at most once per iteration."""
        if code not in self._cur.flagged:
            self._cur.flagged.add(code)
            self._record(finding(code, where, detail, self._cur.index))

    def _on_error(self, exc: BaseException) -> None:
        if self._broken:
            return
        self._broken = True
        self._release()
        self._stack.clear()
        step = getattr(self._cur, "index", None)   # the guard's own state may be what broke
        self._seen[("AMP001", "ScalerGuard")] = _Seen(finding(
            "AMP001", "ScalerGuard", f"{type(exc).__name__}: {exc}; the guard detached itself and training "
            "continues unobserved", step))

    def _stage(self, optimizer: Any) -> OptState:
        state = self.scaler._per_optimizer_states.get(id(optimizer))   # .get: never create an entry
        return state["stage"] if state is not None else OptState.READY

    def _see(self, optimizer: Any) -> None:
        if id(optimizer) not in self._optimizers:
            self._optimizers[id(optimizer)] = weakref.ref(optimizer)
            self._known = None

    def _known_optimizers(self) -> list[Any]:
        """Return the setup's optimizers and those seen in scaler calls."""
        if self._known is None:
            known = {id(o): o for o in self.setup.optimizers}
            for key, ref in self._optimizers.items():
                opt = ref()
                if opt is not None:
                    known.setdefault(key, opt)
            self._known = list(known.values())
        return self._known

    def _settle(self) -> None:
        """Commit the findings of a scaler call that raised (its ``after`` observer never ran)."""
        if not self._stack:
            return
        call = self._stack[0]
        self._stack.clear()
        self._expect_implicit = None
        found = call.predicted or self._infer_failure(call)
        for f in found:
            self._record(f)
        self._crash = found

    def _infer_failure(self, call: _Call) -> list[Finding]:
        opt = call.optimizer
        if opt is None or call.kind not in ("step", "unscale_"):
            return []
        state = self.scaler._per_optimizer_states.get(id(opt))
        if call.kind == "step" and state is not None and state["stage"] is OptState.UNSCALED \
                and not state["found_inf_per_device"]:
            return no_grad_findings(opt, self.setup, self._cur.index)
        if state is None or state["stage"] is OptState.READY:   # raised inside _unscale_grads_
            if any(getattr(p, "grad", None) is not None and p.grad.dtype == torch.float16
                   for g in opt.param_groups for p in g["params"]):
                return fp16_culprits(with_scaler(self.setup, self.scaler), opt, step=self._cur.index)
        return []

    # ---- observers: GradScaler ------------------------------------------------------------------------------

    def _after_call(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if self._live() and self._stack:
            self._stack.pop()

    def _before_scale(self, outputs: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        self._settle()
        s, call = self.scaler, _Call("scale", None, "", self._cur.scale_calls)
        if s._scale is None:
            if s._growth_tracker is not None:
                call.predicted = [finding("AMP405", "GradScaler", "_growth_tracker was set before _scale (a "
                                          "partial state load); load the scaler state with "
                                          "scaler.load_state_dict()", self._cur.index)]
            elif not self._resume_checked:
                self._check_resume()
        self._resume_checked = True
        self._cur.scale_calls += 1
        self._stack.append(call)

    def _check_resume(self) -> None:
        s = self.scaler
        if getattr(s, "_init_growth_tracker", 0) != 0 or s._init_scale != _default_init_scale(type(s)):
            return   # load_state_dict() sets both
        for opt in self.setup.optimizers:
            step = _optimizer_step(opt)
            if step:
                self._record(finding(
                    "AMP410", self._label(opt),
                    f"{self._label(opt)} was restored at step {step:g}, but the GradScaler starts from "
                    f"scale={s._init_scale:g} with growth tracker 0: scaler.load_state_dict() was not called",
                    self._cur.index))
                return

    def _before_unscale(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        if self._expect_implicit == id(optimizer):   # the unscale_ that step() runs itself
            self._expect_implicit = None
            self._stack.append(_Call("unscale_", optimizer, "", self._cur.scale_calls, implicit=True))
            return
        self._settle()
        self._see(optimizer)
        self._calls += 1
        cur, site, stage = self._cur, user_call_site(), self._stage(optimizer)
        call = _Call("unscale_", optimizer, site, cur.scale_calls, seq=self._calls)
        label = self._label(optimizer)
        if self.scaler._scale is None:
            call.predicted = [self._no_scale("unscale_", label, site)]
        elif stage is OptState.UNSCALED:
            call.predicted = self._unscale_twice(optimizer, label, site)
        elif stage is OptState.STEPPED:
            stepped = cur.stepped.get(id(optimizer))
            call.predicted = [finding("AMP403", label, f"scaler.unscale_({label}) at {site} came after "
                                      f"scaler.step({label}) at {stepped.site if stepped else '<unknown>'}; "
                                      "unscale and clip before step()", cur.index)]
        else:
            self._check_scaled(label, "unscale_", site)
            call.grad = _first_grad(optimizer)
            cur.unscaled[id(optimizer)] = call
        self._stack.append(call)

    def _no_scale(self, method: str, label: str, site: str) -> Finding:
        return finding("AMP405", label, f"scaler.{method}() at {site} ran before any scaler.scale(loss): backward() "
                       "ran on the unscaled loss (or the first call after a resume was unscale_)", self._cur.index)

    def _unscale_twice(self, optimizer: Any, label: str, site: str) -> list[Finding]:
        cur = self._cur
        prev = cur.unscaled.get(id(optimizer))
        if prev is None:
            return [finding(code, label, f"scaler.unscale_({label}) at {site} raised; the first unscale_ happened "
                            "before the guard was attached, so its history cannot tell AMP401 from AMP402",
                            cur.index) for code in ("AMP401", "AMP402")]
        backwards = cur.scale_calls - prev.scale_calls
        norm = ""
        if cur.last_clip is not None and cur.last_clip[0] > prev.seq:
            norm = f"; clip_grad_norm_ returned {float(cur.last_clip[1]):.4g} in between"   # crash path: sync ok
        if _grads_reset(prev.grad):
            return [finding("AMP402", label, f"scaler.unscale_({label}) at {prev.site} was followed by neither "
                            f"scaler.step() nor scaler.update(); the gradients were then zeroed and recomputed "
                            f"({backwards} backward pass(es)), and unscale_ at {site} raised{norm}", cur.index)]
        if backwards:
            return [finding("AMP401", label, f"scaler.unscale_({label}) ran at {prev.site} and again at {site} with "
                            f"{backwards} backward pass(es) accumulating gradients in between and no scaler.step()"
                            f"{norm}; unscale and clip once, at the accumulation boundary", cur.index)]
        return [finding("AMP401", label, f"scaler.unscale_({label}) ran at {prev.site} and again at {site} with no "
                        "backward in between: an explicit unscale_ plus a helper that unscales again (e.g. "
                        "accelerator.clip_grad_norm_)", cur.index)]

    def _check_scaled(self, label: str, method: str, site: str) -> None:
        """AMP405, silent: unscale_/step with no scale() since the last update() divides unscaled gradients."""
        if self._window_complete and self._cur.scale_calls == 0:
            self._once("AMP405", label, f"scaler.{method}({label}) at {site} ran with no scaler.scale() call since "
                       "the last update(): the gradients come from an unscaled loss.backward(), so unscale_ divides "
                       "them by the loss scale and the update is that many times too small")

    def _before_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        self._settle()
        self._see(optimizer)
        self._calls += 1
        cur, site, stage, label = self._cur, user_call_site(), self._stage(optimizer), self._label(optimizer)
        call = _Call("step", optimizer, site, cur.scale_calls)
        fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        if "closure" in kwargs:
            call.predicted = [finding("AMP204", label, f"scaler.step({label}, closure=...) at {site} with an "
                                      "enabled GradScaler", cur.index)]
        elif self.scaler._scale is None:
            call.predicted = [self._no_scale("step", label, site)]
        elif stage is OptState.STEPPED:
            first = cur.stepped.get(id(optimizer))
            call.predicted = [finding("AMP404", label, f"scaler.step({label}) at {site} is the second step of "
                                      f"{label} since the last update(); the first was at "
                                      f"{first.site if first else '<unknown>'}", cur.index)]
        else:
            if args and callable(args[0]):
                self._once("AMP204", label, f"scaler.step({label}, closure) at {site}: the closure is passed "
                           "positionally, so GradScaler does not raise, but the closure recomputes gradients "
                           "after they were unscaled")
            if stage is OptState.READY:
                self._check_scaled(label, "step", site)
                if not fused:
                    self._expect_implicit = id(optimizer)
            elif not fused and not self.scaler._per_optimizer_states.get(id(optimizer), {}).get(
                    "found_inf_per_device", True):
                call.predicted = no_grad_findings(optimizer, self.setup, cur.index)
        self._stack.append(call)

    def _after_step(self, result: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        self._expect_implicit = None
        call = self._stack.pop() if self._stack else None
        if call is not None and call.kind == "step":
            self._cur.stepped[id(optimizer)] = call
            self._last_stepped[id(optimizer)] = self._cur

    def _before_update(self, new_scale: Any = None, *args: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        self._settle()
        s, cur = self.scaler, self._cur
        call = _Call("update", None, "", cur.scale_calls)
        states = s._per_optimizer_states
        if s._scale is None:
            call.predicted = [self._no_scale("update", "GradScaler", user_call_site())]
        elif new_scale is None and not any(st["found_inf_per_device"] for st in states.values()):
            site = user_call_site()
            call.predicted = [finding("AMP407", "GradScaler", f"scaler.update() at {site} with no scaler.step() "
                                      f"or unscale_() since the last update() ({cur.scale_calls} scale() "
                                      "call(s) this iteration)", cur.index)]
        else:
            found = {key: list(st["found_inf_per_device"].values()) for key, st in states.items()}
            flags = [t for ts in found.values() for t in ts]
            if len(flags) > 1:
                # update() sums the flags into the first one in place; keep that optimizer's own value
                first_key = next(k for k, ts in found.items() if ts)
                if found[first_key][0].device == s._scale.device:
                    found[first_key][0] = found[first_key][0].clone()
            cur.found_inf = found
        self._stack.append(call)

    def _after_update(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        if self._stack:
            self._stack.pop()
        self._history.append(self._cur)
        self._cur = _Iteration(self._cur.index + 1)
        self._window_complete = True
        if len(self._pending) >= _RESOLVE_EVERY:
            self._resolve()

    # ---- observers: clipping and schedulers -----------------------------------------------------------------

    def _before_clip(self, parameters: Any = None, *args: Any, **kwargs: Any) -> None:
        if not self._live() or self._cur.scale_calls == 0 or "AMP408" in self._cur.flagged:
            return
        candidates = self._known_optimizers()
        ready = [o for o in candidates if self._stage(o) is OptState.READY]
        if not ready:
            return
        owner = self._clip_owner(parameters, ready, len(ready) == len(candidates))
        if owner is not None:
            label = self._label(owner)
            max_norm = args[0] if args else kwargs.get("max_norm", "?")
            self._once("AMP408", label, f"clip_grad_norm_(max_norm={max_norm}) at {user_call_site()} ran before "
                       f"scaler.unscale_({label}): the gradients were still multiplied by the loss scale")

    def _after_clip(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if self._live() and isinstance(result, torch.Tensor):
            self._calls += 1
            self._cur.clips += 1
            self._cur.last_clip = (self._calls, result)

    def _clip_owner(self, parameters: Any, ready: list[Any], all_ready: bool) -> Any:
        """Return the READY optimizer whose parameters are being clipped, or None."""
        if isinstance(parameters, GeneratorType):
            module = _module_of(parameters)
            if module is None:
                return ready[0] if all_ready else None
            owners = self._module_owners.get(id(module))
            if owners is None:   # once per module, and only on this suspicious path
                ids = {id(p) for p in module.parameters()}
                owners = frozenset(id(o) for o in self._known_optimizers() if ids & self._ids_of(o))
                self._module_owners[id(module)] = owners
            return next((o for o in ready if id(o) in owners), None)
        if isinstance(parameters, torch.Tensor):
            tensors: Iterable[Any] = (parameters,)
        elif isinstance(parameters, (list, tuple)):
            tensors = parameters[:_PEEK]
        else:
            return ready[0] if all_ready else None
        keys = {id(t) for t in tensors}
        return next((o for o in ready if keys & self._ids_of(o)), None)

    def _ids_of(self, optimizer: Any) -> frozenset[int]:
        groups = optimizer.param_groups
        key = sum(len(g["params"]) for g in groups)
        cached = self._param_ids.get(id(optimizer))
        if cached is None or cached[0] != key:
            cached = (key, frozenset(id(p) for g in groups for p in g["params"]))
            self._param_ids[id(optimizer)] = cached
        return cached[1]

    def _before_scheduler(self, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live() or getattr(scheduler, "_step_count", 1) == 0:   # the constructor's initial step
            return
        key = id(getattr(scheduler, "optimizer", None))
        if self._stage_of_key(key) is OptState.STEPPED:
            record = self._cur
        else:
            record = self._last_stepped.get(key)
        if record is None or any(k == key for k, _, _ in record.scheduler_steps):
            return
        site = user_call_site()
        record.scheduler_steps.append((key, type(scheduler).__name__, site))
        self._pending.append((record, key, type(scheduler).__name__, site))

    def _stage_of_key(self, key: int) -> OptState:
        state = self.scaler._per_optimizer_states.get(key)
        return state["stage"] if state is not None else OptState.READY

    def _resolve(self, force: bool = False) -> None:
        """Decide pending AMP409 checks: read their found-inf flags in one batch."""
        if not self._pending:
            return
        keep, batch = [], []
        for record, key, cls, site in self._pending:
            flags = record.found_inf.get(key) if record.found_inf is not None else None
            if flags is None and record is self._cur:
                if not force:
                    keep.append((record, key, cls, site))
                    continue
                state = self.scaler._per_optimizer_states.get(key)
                flags = list(state["found_inf_per_device"].values()) if state is not None else None
            if flags:
                batch.append(((record, key, cls, site), flags))
        self._pending = keep
        for ((record, key, cls, site), _), total in zip(batch, _sum_flags([f for _, f in batch])):
            if total > 0:
                opt = self._optimizers.get(key)
                label = self._label(opt()) if opt is not None and opt() is not None else "optimizer"
                self._record(finding("AMP409", f"{cls} on {label}", f"scheduler.step() at {site} advanced the "
                                     f"learning rate after iteration {record.index}, whose optimizer step was "
                                     "skipped (inf/NaN gradients)", record.index))


def _sum_flags(groups: list[list[torch.Tensor]]) -> list[float]:
    """Return the sum of each list of found-inf flags, with one host transfer per device."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, flags in enumerate(groups):
        for t in flags:
            by_device.setdefault(t.device, []).append((i, t))
    sums = [0.0] * len(groups)
    for items in by_device.values():
        values = torch.stack([t.reshape(()).float() for _, t in items]).tolist()
        for (i, _), v in zip(items, values):
            sums[i] += v
    return sums


def _scheduler_classes() -> list[type]:
    """Return LRScheduler and the torch schedulers that define their own step(), except ReduceLROnPlateau."""
    classes = [lr_scheduler.LRScheduler]
    for obj in vars(lr_scheduler).values():
        if (isinstance(obj, type) and issubclass(obj, lr_scheduler.LRScheduler) and "step" in vars(obj)
                and obj is not lr_scheduler.LRScheduler and obj is not lr_scheduler.ReduceLROnPlateau):
            classes.append(obj)
    return classes


def _default_init_scale(cls: type) -> float:
    try:
        default = inspect.signature(cls.__init__).parameters["init_scale"].default
    except (KeyError, TypeError, ValueError):
        return 2.0 ** 16
    return float(default) if isinstance(default, (int, float)) else 2.0 ** 16


def _optimizer_step(optimizer: Any) -> float:
    """Return the ``step`` count of the optimizer's first parameter state (0 when it has none)."""
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is not None:
            return float(step)
    return 0.0
