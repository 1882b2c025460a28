"""Runtime guards for the GradScaler state machine: what the loop did, in which order, and why it failed.

``ScalerGuard`` observes ``scale``, ``unscale_``, ``step`` and ``update`` on one GradScaler, ``clip_grad_norm_``, LR
scheduler steps and the steps of the training's optimizers (hooks on each optimizer, to see a direct
``optimizer.step()`` and a step inside autocast), with pass-through wrappers that detach exactly. Each call costs
O(1) Python and no host sync (found-inf flags stay on the device, read in one batch). Records: `.history`;
decisions: `.checks`; clips: `.clipping`.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from typing import Any

import torch
import torch.nn.utils.clip_grad

from ampdoctor._torch.optim import scheduler_step_count
from ampdoctor._torch.scaler import (
    OptState,
    found_inf_flags,
    growth_tracker,
    is_enabled,
    live_scale,
    optimizer_found_inf,
    stage,
    unscales_itself,
)
from ampdoctor.core.callsite import user_call_site
from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding
from ampdoctor.core.isolation import call_safely, internal_error_finding
from ampdoctor.core.patch import PatchHandle, observe
from ampdoctor.core.training import TrainingSetup
from ampdoctor.core.words import counted
from ampdoctor.explanations.crash import explain_exception
from ampdoctor.guard.checks import (
    ScheduleDrift,
    SkipTally,
    autocast_on,
    infer_failure,
    keep_found_inf,
    loss_reaches,
    missing_grads,
    no_scale,
    resume_finding,
    scheduler_classes,
    scheduler_finding,
    second_step_finding,
    split_pending,
    sum_flags,
    unscale_twice,
)
from ampdoctor.guard.clipping import CLIP_FUNCTIONS, ClipOwners, clip_call
from ampdoctor.guard.history import Call, Iteration, Ledger, Optimizers, first_grad, first_param_device

__all__ = ["ScalerGuard"]

_HISTORY = 64          # closed iterations kept for explanations
_RESOLVE_EVERY = 32    # scheduler checks batched into one host sync
_ROOTS = 4             # scaled losses' graph roots kept per iteration (gradient accumulation: the last few)


class ScalerGuard:
    """Watch a GradScaler's state machine and report misuse as findings.

    Args:
        scaler: the ``torch.amp.GradScaler`` to observe; its methods are wrapped on the instance only.
        setup: the training objects, for names and optimizer numbers.
        observe_clipping: observe ``clip_grad_norm_`` itself (the Doctor observes it process-wide and forwards).
        restore_facts: the ``load_state_dict`` calls seen (``core.facts.ProcessFacts``); else a resume is inferred.

    >>> model = torch.nn.Linear(4, 4); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = torch.amp.GradScaler("cpu")
    >>> with ScalerGuard(scaler, TrainingSetup(model, opt)) as guard:
    ...     scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    ...     _ = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)     # still scaled
    ...     _ = scaler.step(opt); scaler.update()
    >>> [f.code for f in guard.findings()]
    ['AMP408']
    """

    def __init__(self, scaler: Any, setup: TrainingSetup | None = None, *, observe_clipping: bool = True,
                 restore_facts: Any = None) -> None:
        self.scaler = scaler
        self.observe_clipping = observe_clipping
        self.restore_facts = restore_facts
        self.setup = setup if setup is not None else TrainingSetup(scaler=scaler)
        self._handles: list[PatchHandle] = []
        self._step_hooks: dict[int, list[Any]] = {}   # id(optimizer) -> its step pre/post hook handles
        self._broken = False
        self._cur = Iteration(0)
        self._history: deque[Iteration] = deque(maxlen=_HISTORY)
        self._ledger = Ledger()
        self._crash: list[Finding] = []
        self._stack: list[Call] = []
        self._expect_implicit: int | None = None
        self._optimizers = Optimizers()
        self._last_stepped: dict[int, Iteration] = {}
        self._pending: list[tuple[Iteration, int, str, str, list[Any]]] = []
        self._drift, self._tally = ScheduleDrift(), SkipTally()  # AMP409: counted on the device, read at the end
        self._clip_owners = ClipOwners()
        self._on = False
        self._calls = 0
        self._window_complete = False
        self._resume_checked = False
        self._scaler_steps = 0                              # scaler.step() calls, to tell a wrapper's step
        self._direct: dict[int, tuple[int, str]] = {}       # AMP412 candidates: id(opt) -> (scaler steps, site)
        self._reached: dict[int, bool] = {}                 # AMP412: does a scaled loss reach this optimizer
        self._entered: dict[int, tuple[int, Iteration]] = {}   # id(opt) -> (scaler steps, iteration) at its step
        self._updated = False            # update() returned once: from then on it alone ends an iteration
        self._closed_directly = False    # an iteration ended at a direct optimizer step since the last update()
        self._lead: weakref.ref | None = None   # the optimizer whose direct steps end iterations
        self._others: set[int] = set()   # other optimizers stepped directly since the last such end
        self._roots: list[Any] = []   # the graph roots of this iteration's last scaled losses (nodes; saved tensors
        #                               are freed by their backward), until update()

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def attach(self) -> "ScalerGuard":
        """Install the observers; a second call does nothing."""
        if self._handles or self._broken:
            return self
        s, err = self.scaler, self._on_error
        self._handles = [
            observe(s, "scale", before=self._before_scale, after=self._after_scale, on_error=err),
            observe(s, "unscale_", before=self._before_unscale, after=self._after_call, on_error=err),
            observe(s, "step", before=self._before_step, after=self._after_step, on_error=err),
            observe(s, "update", before=self._before_update, after=self._after_update, on_error=err),
        ]
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad) if self.observe_clipping else ():
            self._handles += [observe(owner, n, before=functools.partial(self._before_clip, n), after=self._after_clip,
                                      on_error=err) for n in CLIP_FUNCTIONS if callable(owner.__dict__.get(n))]
        for cls in scheduler_classes():
            self._handles.append(observe(cls, "step", before=self._before_scheduler, on_error=err,
                                         after=lambda _, sched, *a, **k: self._live() and self._drift.after(sched)))
        self._window_complete = live_scale(s) is None   # a fresh scaler: this iteration is whole
        self._on = is_enabled(s)   # a disabled scaler's methods are no-ops
        if self._on:
            self._hook_optimizers()
        return self

    def detach(self) -> None:
        """Remove every observer, restoring the original attributes exactly."""
        try:
            self._catch_up()
        finally:
            self._release()

    def _catch_up(self) -> None:
        """Commit a raised call and decide pending checks; an internal error becomes AMP001."""
        call_safely(self._settle_all, on_error=self._on_error)   # the guard's bookkeeping never breaks the caller

    def _settle_all(self) -> None:
        self._settle()
        self._resolve(force=True)

    def _release(self, step_hooks: bool = True) -> None:
        self._on = False
        self._roots = []
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        if not step_hooks:
            return   # an error inside an optimizer's step hook: torch is iterating them; inert now, removed at detach
        for handles in self._step_hooks.values():
            for handle in handles:
                handle.remove()
        self._step_hooks = {}

    def _hook_optimizers(self) -> None:
        """Hook the step of each optimizer of the setup not hooked yet (instance hooks: a global one registered
        from inside another optimizer hook would change the dict torch is iterating)."""
        for opt in self.setup.optimizers:
            if id(opt) in self._step_hooks:
                continue
            try:
                self._step_hooks[id(opt)] = [opt.register_step_pre_hook(self._before_optimizer_step),
                                             opt.register_step_post_hook(self._after_optimizer_step)]
            except (AttributeError, TypeError, RuntimeError):   # a wrapper that is no complete torch Optimizer
                self._step_hooks[id(opt)] = []

    def __enter__(self) -> "ScalerGuard":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ---- results --------------------------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        """The number of iterations ended so far: ``update()`` calls, and before the first of them, direct
        optimizer steps the scaler took no part in."""
        return getattr(self._cur, "index", 0)

    @property
    def broken(self) -> bool:
        """True once an internal error made the guard detach itself (reported as AMP001)."""
        return self._broken

    def findings(self) -> list[Finding]:
        """Return what went wrong so far; repeated findings are reported once with their count."""
        self._catch_up()
        cur = self._cur
        return self._drift.escalate(self._ledger.findings(), cur.index + bool(cur.stepped) if cur else 0)

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
        sums = sum_flags([[t for ts in r.found_inf.values() for t in ts] for r in records])
        return [r.index for r, total in zip(records, sums) if total > 0]

    # ---- events forwarded by the Doctor's process-wide observers ---------------------------------------------
    def clip_started(self, parameters: Any, args: tuple, kwargs: dict, name: str = "clip_grad_norm_") -> None:
        """Observe a clipping call (``name``) seen by a process-wide observer (with ``observe_clipping=False``)."""
        self._forward(self._before_clip, name, parameters, *args, **kwargs)

    def clip_finished(self, result: Any) -> None:
        """Observe the end of that clipping call."""
        self._forward(self._after_clip, result)

    @property
    def clipped_scaled(self) -> bool:
        """Whether this iteration clipped gradients that still carried the loss scale (AMP408)."""
        return "AMP408" in self._cur.flagged

    def adopt_scale_call(self, outputs: Any = None, *args: Any, **kwargs: Any) -> None:
        """Count a ``scale()`` call that was already running when the guard attached (its observer missed it)."""
        self._forward(self._before_scale, outputs)
        self._forward(self._after_call, None)

    def _forward(self, observer: Any, *args: Any, **kwargs: Any) -> None:
        if not self._broken:   # a guard that stepped aside observes nothing more
            call_safely(observer, *args, on_error=self._on_error, **kwargs)

    def state_restored(self) -> None:
        """Check for a resume without the scaler state again at the next ``scale()`` (a load_state_dict ran)."""
        self._resume_checked = False

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def _live(self) -> bool:
        return self._on

    def _label(self, optimizer: Any) -> str:
        return self._optimizers.label(optimizer, self.setup)

    def _record(self, f: Finding) -> None:
        self._ledger.record(f)

    def _once(self, code: str, where: str, detail: str, flag: str | None = None) -> None:
        """Record a silent finding at most once per iteration (per ``flag``, the code when not given)."""
        flag = flag or code
        if flag not in self._cur.flagged:
            self._cur.flagged.add(flag)
            self._record(get_rule(code).finding(where, detail, self._cur.index))

    def _on_error(self, exc: BaseException) -> None:
        if self._broken:
            return
        self._broken = True
        self._release(step_hooks=False)
        self._stack.clear()
        step = getattr(self._cur, "index", None)   # the guard's own state may be what broke
        self._ledger.replace(internal_error_finding(
            exc, "ScalerGuard", step, "; the guard detached itself and training continues unobserved"))

    def _stage(self, optimizer: Any) -> OptState:
        """Return the stage of an optimizer (or its id) in this iteration, without creating scaler state."""
        return stage(self.scaler, optimizer)

    def _settle(self) -> None:
        """Commit the findings of a scaler call that raised (its ``after`` observer never ran)."""
        if not self._stack:
            return
        call = self._stack[0]
        self._stack.clear()
        self._expect_implicit = None
        found = call.predicted or infer_failure(self.scaler, self.setup, call, self._cur.index,
                                                self._reset_after_backward(call))
        for f in found:
            self._record(f)
        self._crash = found

    # ---- observers: GradScaler ------------------------------------------------------------------------------
    def _after_call(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if self._live() and self._stack:
            self._stack.pop()

    def _before_scale(self, outputs: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        self._settle()
        s, call = self.scaler, Call("scale", None, "", self._cur.scale_calls)
        if live_scale(s) is None and growth_tracker(s) is not None:
            call.predicted = [get_rule("AMP405").finding("GradScaler", "_growth_tracker was set before _scale (a "
                                      "partial state load); load the scaler state with "
                                      "scaler.load_state_dict()", self._cur.index)]
        elif not self._resume_checked:
            resumed = resume_finding(s, self.setup.optimizers, self._label, self._cur.index, self.restore_facts)
            if resumed is not None:
                self._record(resumed)
        self._resume_checked = True
        self._cur.scale_calls += 1
        if isinstance(outputs, torch.Tensor):
            if outputs.grad_fn is not None:
                self._roots = [*self._roots[-(_ROOTS - 1):], outputs.grad_fn]
            if autocast_on(outputs.device.type):   # suspicious: is the backward inside autocast too?
                call.autocast = (outputs.device.type, user_call_site())
        self._hook_optimizers()
        self._stack.append(call)

    def _after_scale(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live() or not self._stack:
            return
        call = self._stack.pop()
        if isinstance(result, torch.Tensor) and result.requires_grad:
            # runs as backward starts, where the caller's autocast state is seen (the engine carries it)
            result.register_hook(functools.partial(self._scaled_backward, self._cur, call.autocast))

    def _scaled_backward(self, iteration: Iteration, autocast: tuple[str, str] | None, grad: Any) -> None:
        iteration.backward = True
        if autocast is not None:
            self._forward(self._check_backward_autocast, *autocast)

    def _check_backward_autocast(self, device: str, scale_site: str) -> None:
        """AMP413: the backward of a scaled loss started while autocast was enabled for its device."""
        if not autocast_on(device):
            return
        site = user_call_site()
        site = scale_site if site == "<unknown>" else site   # a device thread runs the backward: no user frame
        self._once("AMP413", "loss.backward()", f"scaler.scale(loss).backward() at {site} ran inside an enabled "
                   f"torch.autocast({device!r}) region: move the backward (and the optimizer step) out of the "
                   "with torch.autocast(...) block, which should hold only the forward and the loss",
                   flag="AMP413 backward")

    def _before_unscale(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        if self._expect_implicit == id(optimizer):   # the unscale_ that step() runs itself
            self._expect_implicit = None
            self._stack.append(Call("unscale_", optimizer, "", self._cur.scale_calls, implicit=True))
            return
        self._settle()
        self._optimizers.see(optimizer)
        self._calls += 1
        cur, site, stage = self._cur, user_call_site(), self._stage(optimizer)
        call = Call("unscale_", optimizer, site, cur.scale_calls, seq=self._calls)
        label = self._label(optimizer)
        if live_scale(self.scaler) is None:
            call.predicted = [no_scale("unscale_", label, site, cur.index)]
        elif stage is OptState.UNSCALED:
            call.predicted = unscale_twice(cur, optimizer, label, site)
        elif stage is OptState.STEPPED:
            stepped = cur.stepped.get(id(optimizer))
            call.predicted = [get_rule("AMP403").finding(label, f"scaler.unscale_({label}) at {site} came after "
                                      f"scaler.step({label}) at {stepped.site if stepped else '<unknown>'}; "
                                      "unscale and clip before step()", cur.index)]
        else:
            self._check_scaled(label, "unscale_", site)
            call.grad = first_grad(optimizer)
            cur.unscaled[id(optimizer)] = call
        self._stack.append(call)

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
        self._optimizers.see(optimizer)
        self._calls += 1
        self._scaler_steps += 1
        cur, site, stage, label = self._cur, user_call_site(), self._stage(optimizer), self._label(optimizer)
        call = Call("step", optimizer, site, cur.scale_calls)
        fused = unscales_itself(optimizer)
        if "closure" in kwargs:
            call.predicted = [get_rule("AMP204").finding(
                label, f"scaler.step({label}, closure=...) at {site} with an enabled GradScaler", cur.index)]
        elif live_scale(self.scaler) is None:
            call.predicted = [no_scale("step", label, site, cur.index)]
        elif stage is OptState.STEPPED:
            first = cur.stepped.get(id(optimizer))
            call.predicted = [second_step_finding(first, label, site, cur.scale_calls, cur.index)]
        else:
            if args and callable(args[0]):
                self._once("AMP204", label, f"scaler.step({label}, closure) at {site}: the closure is passed "
                           "positionally, so GradScaler does not raise, but the closure recomputes gradients "
                           "after they were unscaled")
            if stage is OptState.READY:
                self._check_scaled(label, "step", site)
                if not fused:
                    self._expect_implicit = id(optimizer)
            elif not fused and optimizer_found_inf(self.scaler, optimizer) == []:   # unscale_ saw no gradients
                call.predicted = missing_grads(optimizer, self.setup, cur.index, self._reset_after_backward(call))
        self._stack.append(call)

    def _reset_after_backward(self, call: Call) -> bool:
        """Whether a backward of a loss scaled in this iteration reached ``call``'s optimizer's parameters: when
        they have no gradient at its step, something reset them in between (zero_grad() between backward and
        step: AMP612, not AMP406)."""
        return call.optimizer is not None and self._cur.backward and \
            loss_reaches(self._roots, call.optimizer) is True

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
        call = Call("update", None, "", cur.scale_calls)
        scale, found = live_scale(s), found_inf_flags(s)
        if scale is None:
            call.predicted = [no_scale("update", "GradScaler", user_call_site(), cur.index)]
        elif new_scale is None and not any(found.values()):
            site = user_call_site()
            call.predicted = [get_rule("AMP407").finding(
                "GradScaler", f"scaler.update() at {site} with no scaler.step() or unscale_() since the last update() "
                f"({counted(cur.scale_calls, 'scale() call')} this iteration)", cur.index)]
        else:
            cur.found_inf = keep_found_inf(found, scale)
        self._stack.append(call)

    def _after_update(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live():
            return
        if self._stack:
            self._stack.pop()
        cur, closed, self._closed_directly, self._updated = self._cur, self._closed_directly, False, True
        lead = self._lead() if self._lead is not None else None
        # the lead's direct step ended this iteration already, and the scaler did not step it: this update() is
        # part of that iteration (update(new_scale) after AMP412's step; a GAN's scaled half after its fp32 one)
        same = closed and lead is not None and id(lead) not in cur.stepped and id(lead) not in cur.unscaled
        self._close_iteration(advance=not same)
        if len(self._pending) >= _RESOLVE_EVERY:
            self._resolve()

    def _close_iteration(self, advance: bool = True) -> None:
        self._history.append(self._cur)
        self._cur = Iteration(self._cur.index + int(advance))
        self._roots = []
        self._window_complete = True

    # ---- observers: the optimizers' own steps ----------------------------------------------------------------
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._forward(self._optimizer_step_started, optimizer)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._forward(self._optimizer_step_finished, optimizer)

    def _optimizer_step_started(self, optimizer: Any) -> None:
        if not self._live():
            return
        self._entered[id(optimizer)] = (self._scaler_steps, self._cur)
        device = first_param_device(optimizer)
        if device is not None and autocast_on(device):
            label = self._label(optimizer)
            self._once("AMP413", label, f"{label}.step() at {user_call_site()} ran inside an enabled "
                       f"torch.autocast({device!r}) region: the fp16 weight copies autocast cached for the region "
                       "are stale after the update; move scaler.step()/optimizer.step() and the backward out of "
                       "the with torch.autocast(...) block", flag="AMP413 step")
        if any(c.kind == "step" for c in self._stack):
            return   # scaler.step(optimizer) calling it: the right way
        if self._cur.scale_calls and self._stage(optimizer) is OptState.READY:
            self._direct[id(optimizer)] = (self._scaler_steps, user_call_site())

    def _optimizer_step_finished(self, optimizer: Any) -> None:
        entered = self._entered.pop(id(optimizer), None)
        if not self._live() or entered is None:
            return
        self._check_direct_step(optimizer)
        cur = self._cur
        if entered != (self._scaler_steps, cur) or self._updated or cur.stepped or cur.unscaled \
                or any(c.kind == "step" for c in self._stack):
            return   # the scaler takes part: update() ends the iteration
        if cur.scale_calls and not self._scaled_by_loss(optimizer):
            return   # the loss scaled in this iteration trains another optimizer (a GAN's): its update() ends it
        self._end_direct_iteration(optimizer)

    def _end_direct_iteration(self, optimizer: Any) -> None:
        """End the iteration at a step the scaler took no part in (no ``scaler.step()``, ``unscale_()`` or
        ``update()`` in this iteration, none inside the step; a loss scaled in it reached this optimizer), before
        the scaler's first ``update()``: AMP412's loop, or a scaler never used, calls none, and the iterations must
        still count (the steps of a crash explanation, as the watch's). One optimizer's steps end them (the first
        to step so, held weakly); another takes over when it steps twice in one of them (a new stage's)."""
        lead = self._lead() if self._lead is not None else None
        if lead is not None and lead is not optimizer and id(optimizer) not in self._others:
            self._others.add(id(optimizer))   # a second optimizer of the same iteration (a GAN's)
            return
        self._lead, self._others = weakref.ref(optimizer), set()
        self._closed_directly = True
        self._close_iteration()

    def _check_direct_step(self, optimizer: Any) -> None:
        """AMP412: a step outside scaler.step() on gradients a scaled loss produced (no scaler.step() inside it:
        a wrapper whose step calls scaler.step() is the right way)."""
        started = self._direct.pop(id(optimizer), None)
        if started is None or started[0] != self._scaler_steps:
            return
        if not self._scaled_by_loss(optimizer):
            return
        label = self._label(optimizer)
        # Adam-style steps divide the scale out of m / sqrt(v), all but eps; an SGD-style step is multiplied by it
        harm = ("its eps acts that many times smaller" if "eps" in getattr(optimizer, "defaults", {})
                else "the update is that many times too large")
        self._once("AMP412", label, f"{label}.step() at {started[1]} ran directly, not through scaler.step(): its "
                   "gradients came from scaler.scale(loss).backward() and are still multiplied by the loss scale "
                   f"(scaler.get_scale()), so {harm}, and inf/NaN gradients are applied instead of skipped; call "
                   "scaler.step(optimizer) then scaler.update()")

    def _scaled_by_loss(self, optimizer: Any) -> bool:
        """Return whether a loss given to scale() in this iteration back-propagates into ``optimizer``'s parameters
        (its autograd graph walked once per optimizer); when no graph is left, whether the scaler stepped it before."""
        known = self._reached.get(id(optimizer))
        if known is None:
            reached = loss_reaches(self._roots, optimizer)
            if reached is None:
                return id(optimizer) in self._optimizers.seen
            known = self._reached[id(optimizer)] = reached
        return known

    # ---- observers: clipping and schedulers -----------------------------------------------------------------
    def _before_clip(self, name: str, parameters: Any = None, *args: Any, **kwargs: Any) -> None:
        if not self._live() or self._cur.scale_calls == 0 or "AMP408" in self._cur.flagged:
            return
        candidates = self._optimizers.known(self.setup)
        ready = [o for o in candidates if self._stage(o) is OptState.READY]
        if not ready:
            return
        owner = self._clip_owners.owner(parameters, ready, len(ready) == len(candidates), candidates)
        if owner is not None:
            label = self._label(owner)
            self._once("AMP408", label, f"{clip_call(name, args, kwargs)} at {user_call_site()} ran before "
                       f"scaler.unscale_({label}): the gradients were still multiplied by the loss scale")

    def _after_clip(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if self._live() and isinstance(result, torch.Tensor):
            self._calls += 1
            self._cur.clips += 1
            self._cur.last_clip = (self._calls, result)

    def _before_scheduler(self, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        if not self._live() or scheduler_step_count(scheduler) == 0:   # the constructor's initial step
            return
        key = id(getattr(scheduler, "optimizer", None))
        if self._stage(key) is OptState.STEPPED:
            record = self._cur
        else:
            record = self._last_stepped.get(key)
        if record is None or any(k == key for k, _, _ in record.scheduler_steps):
            return
        site = user_call_site()
        record.scheduler_steps.append((key, type(scheduler).__name__, site))
        self._pending.append((record, key, type(scheduler).__name__, site, self._drift.before(scheduler)))

    def _resolve(self, force: bool = False) -> None:
        """Count pending AMP409 checks on the device; with ``force`` (findings asked for) read the counts once."""
        if self._pending:
            self._pending, batch = split_pending(self._pending, self._cur, self.scaler, force)
            self._tally.add(batch)
        for (key, cls, site), count, first, last, factor in (self._tally.read() if force else ()):
            f = scheduler_finding(cls, self._optimizers.label_of(key, self.setup), site, first)
            self._drift.set(f.where, count, factor, (key, cls))
            self._ledger.set_span(f, count, last)
