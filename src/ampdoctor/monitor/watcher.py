"""Watch the numerics of a training run: a step clock, the sampling, one host copy per sampled step, and its parts.

The `Watch` keeps four things and loops over its parts (``monitor.part``, the built-in ones in ``monitor.parts``)
for everything it measures:

* **The step clock.** A step ends when ``scaler.update()`` returns (without a scaler: ``optimizer.step()``, or a
  DeepSpeed optimizer's ``step()``, which steps it once per group; with one, also a direct ``optimizer.step()`` it
  took no part in before its first ``update()``: AMP412's loop, or a scaler never used, calls none). A library's own
  loss scaler (fairseq's, DeepSpeed's, ...: ``_compat.loss_scalers``) skips a step by not stepping the optimizer:
  its decision to skip ends that step (unless an engine's ``step()`` ends every step anyway). On a sampled
  step the gradients are final just before ``scaler.step(optimizer)`` (observed, pass-through) with an enabled
  GradScaler, else in an optimizer step pre-hook (or when a ``step(closure)``'s closure returns; also with a
  GradScaler that never scaled a loss): clipped, if the loop clips, and not yet used; the scaler's stage for this
  optimizer (or the ``optimizer.grad_scale`` it sets for fused optimizers) says whether they still carry the loss
  scale (the parts' ``read_point``). Wrapped optimizers (accelerate's, ``MasterWeights``, DeepSpeed's, stacked) are
  seen through: ``monitor.watched``.
* **The sampling**: the first steps, every ``every``-th, and more after trouble (``monitor.sampling``).
* **One host copy per sampled step**: every part's device values, read at once on CPU and after the next step on
  CUDA (``monitor.host_sync``; ``host_syncs`` counts every read: ``core.host_reads``); the parts turn them into the
  step line (``core.records``), which raises their alarms.
* **The flight recorder** (``core.records.file``) of those lines.

The summary (``core.records.WatchSummary``) holds each part's section; the invariants of training health and the
arbitration between the parts' findings read it (``monitor.verdicts``).

Do no harm: nothing here writes to parameters, gradients, optimizer or scaler state, or the global RNG; ``detach()``
removes every hook and drops the references. An internal exception is reported once as AMP001 and that part stops.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ampdoctor._compat.loss_scalers import loss_scaler_shape
from ampdoctor._torch.distributed import fsdp1_layouts, param_layout
from ampdoctor._torch.scaler import OptState, live_scale, stage
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.environment import environment
from ampdoctor.core.findings import Finding
from ampdoctor.core.formats import run_formats
from ampdoctor.core.host_reads import HostReads
from ampdoctor.core.isolation import call_safely
from ampdoctor.core.names import Names
from ampdoctor.core.options import AUDIT_OFF, check_audit, check_every
from ampdoctor.core.patch import observe
from ampdoctor.core.records import FlightRecorder, GradientSummary, WatchSummary, read_step, step_line
from ampdoctor.core.report import Report
from ampdoctor.core.views import Drawn
from ampdoctor.monitor.gradients import SUBNORMAL_FRACTION, UNDERFLOW_FRACTION
from ampdoctor.monitor.header import log_header
from ampdoctor.monitor.host_sync import HostCopy
from ampdoctor.monitor.part import PartsAside, Reading, WatchContext, WatchPart
from ampdoctor.monitor.parts import parts
from ampdoctor.monitor.sampling import DENSE_STEPS, Sampling
from ampdoctor.monitor.verdicts import invariant_findings, verified, watch_findings
from ampdoctor.monitor.watched import (
    EngineCopies,
    closure_calls_back,
    name_params,
    param_owners,
    refuse_meta,
    scaler_of,
    steps_through,
    watched_chain,
)

__all__ = ["watch", "Watch", "WatchView", "STATS", "UNDERFLOW_FRACTION", "SUBNORMAL_FRACTION"]

STATS = ("norms", "full", "exact")  # what GradStats computes: see Watch (AMP605 thresholds: monitor.gradients)
_SECTIONS = ("scale", "gradients", "lost_updates", "activations", "updates", "loss", "averages")   # the built-in


@dataclass(frozen=True)
class WatchView(Drawn):
    """A watch's summary to show (``rich.print(w.summary())``; drawn by ``ampdoctor.ui.watch_view``).

    Attributes:
        summary: ``Watch.watch_summary()``.
        findings: the watch's findings to list under it; ``[]``: say the verdict; None: shown elsewhere.
    """

    summary: WatchSummary
    findings: list[Finding] | None = None


def watch(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None, *, every: int = 50,
          log_dir: str | None = None, activations: bool = False, stats: str = "full", sample: int = 4096,
          fsync: bool = False, dense: int = DENSE_STEPS, audit: Any = AUDIT_OFF) -> "Watch":
    """Attach a :class:`Watch` to a training loop and return it; use it as a context manager or call ``detach()``.

    >>> model = nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with watch(model, opt, every=1) as w:
    ...     model(torch.ones(3, 4)).sum().backward(); opt.step()
    >>> w.steps, w.host_syncs   # the step's one copy (with the activation monitor's values, armed for the dense start)
    (1, 1)
    """
    return Watch(model, optimizer, scaler, every=every, log_dir=log_dir, activations=activations, stats=stats,
                 sample=sample, fsync=fsync, dense=dense, audit=audit).attach()


class Watch:
    """The numerics watch of one model, its optimizer and (optionally) its GradScaler.

    Args:
        model: the module being trained (used for parameter and module names, and activation hooks).
        optimizer: the optimizer stepping it, or a wrapper that delegates to one (accelerate's, ``MasterWeights``);
            the statistics cover its parameters.
        scaler: the ``torch.amp.GradScaler``, if any (default: an ``AcceleratedOptimizer``'s). A disabled one is none.
            A library's own loss scaler given here (fairseq's ``DynamicLossScaler``, DeepSpeed's, apex's,
            Megatron-LM's: ``ampdoctor._compat.loss_scalers``) is followed as ``loss_scaler``.
        every: look closely at every ``every``-th optimizer step (step 0 first); 1 = every step.
        dense: also look closely at each of the first ``dense`` steps (see ``ampdoctor.monitor.sampling``).
        log_dir: write the JSON-lines flight recorder ``ampdoctor.jsonl`` there (or to this ``.jsonl`` file).
        activations: also run ``ActivationMonitor`` (first non-finite module, fp16 headroom) on sampled steps.
        stats: ``"norms"`` (L2 and abs-max), ``"full"`` (everything; counts from ``sample`` entries per
            parameter, exact for smaller ones) or ``"exact"`` (every count over every entry; slow).
        sample: entries per parameter for the counts and the lost-update snapshots (of a parameter wider than
            fp16/bf16, at most ``monitor.updates.MOVED_SAMPLE``: its lost updates are not counted).
        fsync: fsync the log after every line (see ``ampdoctor.core.records.file``).
        others: other models the optimizer may also train, to name their parameters (``ampdoctor run``'s).
        frozen: returns the models that ran a forward with nothing to train (a teacher, a VAE; ``ampdoctor run``'s):
            the look at the forward covers them and ``others`` (``ActivationMonitor``'s ``others``).
        names: how the run names what the script holds (``core.names.Names``; a watch alone has its own).
        loss_scaler: a library's own loss scaler (``ampdoctor run`` finds it among the live objects): without an
            enabled GradScaler, its scale and skipped steps are the loss scale's part's, and a skip ends the step.
        audit: the steps the numerics audit re-runs in fp32 (``core.options.check_audit``): off unless asked here;
            ``ampdoctor run`` and ``attach()`` ask for ``"auto"``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None, *, every: int = 50,
                 log_dir: str | None = None, activations: bool = False, stats: str = "full", sample: int = 4096,
                 fsync: bool = False, dense: int = DENSE_STEPS, others: Sequence[nn.Module] = (),
                 frozen: Callable[[], Sequence[nn.Module]] | None = None, names: Names | None = None,
                 loss_scaler: Any = None, audit: Any = AUDIT_OFF) -> None:
        chain = watched_chain(model, optimizer)
        optimizer = chain[-1]  # the torch optimizer that applies the update: its step hooks fire
        check_every(every)
        if stats not in STATS:
            raise ValueError(f"stats must be one of {STATS}, got {stats!r}")
        refuse_meta(model, optimizer)
        self.every, self.stats, self.sample, self.log_dir, self.fsync = every, stats, sample, log_dir, fsync
        self._model: nn.Module | None = model
        self._optimizer: torch.optim.Optimizer | None = optimizer
        self._chain: list[Any] = chain  # the optimizer as given, the ones it wraps, ..., self._optimizer
        if loss_scaler is None and loss_scaler_shape(scaler) is not None:
            scaler, loss_scaler = None, scaler   # a library's own loss scaler, given as the scaler
        self._scaler = scaler_of(chain, scaler)  # None: an AcceleratedOptimizer's, if it holds one
        self._loss_scaler = loss_scaler if self._scaler is None and loss_scaler_shape(loss_scaler) is not None else None
        self.steps = 0  # completed optimizer steps (scaler.update() calls with a scaler, and direct steps)
        self.sampled_steps = 0
        self.reads = HostReads("watch")  # every host read of the watch and its parts: host_syncs (core.host_reads)
        self._ctx: WatchContext | None
        self._ctx, self._stepper = self._context(model, optimizer, chain, others, frozen, names or Names(),
                                                 activations, dense)
        self._ctx.audit = check_audit(audit)
        self.param_names, self.param_modules, self.param_dtypes = self._ctx.names, self._ctx.modules, self._ctx.dtypes
        self._through_scaler = False   # scaler.step() of the watched optimizer since the last update()
        self._ended_directly = False   # a step ended at a direct optimizer.step() since the last update()
        self._updated = False          # scaler.update() returned once: from then on it ends every step
        # seconds spent closing steps (sync, record, log line); the parts' own hooks add theirs (seconds_inside)
        self._seconds = 0.0
        self.last_record: dict[str, Any] | None = None
        self._sampled_now = True
        self._sampling = Sampling(every, dense)
        self._handles: list[Any] = []
        self._ran_hooks: dict[int, Any] = {}
        self._autocast: str | None = None   # the autocast dtype of the model's first forward after attach, if any
        self._formats: list[str] | None = None   # the formats the run is measured in, chosen at its first forward
        self._scaled = self._scaler is not None   # an fp16 GradScaler is enabled: fp16 is one of the formats
        self._classes = parts()
        self._parts: list[WatchPart] = []
        self._aside = PartsAside([cls.name for cls in self._classes], step=lambda: self.steps, on_fail=self._stop)
        self._ctx.off = self._aside.off
        self._recorder: FlightRecorder | None = None
        self._deferred: tuple[HostCopy, int, float, dict[str, Any], bool] | None = None  # a step's copy, not read
        self._started = time.perf_counter()
        self.attached = False

    def _context(self, model: nn.Module, optimizer: torch.optim.Optimizer, chain: list[Any],
                 others: Sequence[nn.Module], frozen: Callable[[], Sequence[nn.Module]] | None, names: Names,
                 activations: bool, dense: int) -> tuple[WatchContext, Any]:
        """Return what the parts are handed (the watched tensors by the names the findings use, an engine's fp32
        copies named where the engine keeps them, their models and layouts), and the engine optimizer whose
        ``step()`` is one training step (None without one)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        named, modules, dtypes, prefix = name_params(model, params, others, optimizer, names)
        # The models the watched tensors belong to (``model`` first), while attached, and each tensor's (None: no
        # model's). AMP617 counts the tensors of the models this run trains (a forward ran while watched, or one of
        # their tensors got a gradient), not those of a model the script replaced (a resume, a re-run cell).
        models = [model, *[m for m in others if m is not model]]
        copies = EngineCopies([*chain, model], params, named, modules, optimizer)
        layouts = {**fsdp1_layouts(model), **copies.layouts}   # sharded ones are merged over their ranks
        return WatchContext(
            model=model, optimizer=optimizer, chain=chain, scaler=self._scaler, params=params, names=named,
            modules=modules, dtypes=dtypes, prefix=prefix, every=self.every, stats=self.stats, sample=self.sample,
            dense=dense, activations=activations, reads=self.reads, fail=self._fail, steps=lambda: self.steps,
            run_names=names, models=models, owners=param_owners(models, params), others=list(others), frozen=frozen,
            layouts=[param_layout(p, layouts) for p in params], padding=copies.padding, loss_scaler=self._loss_scaler,
            left_out={} if params else {type(optimizer).__name__: copies.why_empty()}), copies.stepper

    @property
    def seconds_inside(self) -> float:
        """Seconds spent inside the watch: the ends of steps and every part's own hooks (the statistics, the
        lost-update hooks, the activation monitor's forward hooks)."""
        return self._seconds + sum(part.seconds for part in self._parts)

    # ---- attaching ------------------------------------------------------------------------------------------------
    def attach(self) -> "Watch":
        """Register every part's hooks, then the step clock's; return ``self``. Attaching twice is a no-op."""
        if self.attached or self._optimizer is None:
            return self
        opt, scaler = self._optimizer, self._scaler
        self.attached = True
        try:
            # the parts first: without a scaler the step ends in the clock's post-hook, after the updates' own, and
            # the clock's scaler.update observer wraps the loss scale's, so the step ends after that one ran
            for cls in self._classes:
                self._aside.guard(cls.name, self._start_part, cls)
            if scaler is not None:
                self._handles.append(observe(scaler, "step", before=self._before_scaler_step,
                                             on_error=lambda e: self._fail("gradients", e)))
                self._handles.append(observe(scaler, "update", after=self._after_update,
                                             on_error=lambda e: self._fail("watch", e)))
            self._handles.append(opt.register_step_pre_hook(self._optimizer_pre_hook))
            # an engine optimizer's groups are each read as stepped; the step ends with the engine's step(). With a
            # scaler, only a step it takes no part in ends there (optimizer.step() called directly)
            ended = self._step_done if scaler is None else self._after_direct_step
            self._handles.append(opt.register_step_post_hook(ended) if self._stepper is None else
                                 observe(self._stepper, "step", after=ended, on_error=lambda e: self._fail("watch", e)))
            if scaler is None and self._loss_scaler is not None and self._stepper is None:
                self._handles.append(self._end_skipped_steps(self._loss_scaler))
            self._note_forwards()
            if self.log_dir is not None:  # an unwritable log_dir must not stop the training: AMP001 says so
                self._guard("recorder", self._open_recorder)
            self._set_sampling(self._sampling.sampled(self.steps))
        except Exception:
            self.detach()
            raise
        return self

    def _start_part(self, cls: type[WatchPart]) -> None:
        part = cls.create(self._ctx)
        if part is not None:
            self._parts.append(part)   # before its attach: a part whose attach fails is still detached
            part.attach()

    def _note_forwards(self) -> None:
        """Once per model: that its forward ran, and the model's forward's autocast dtype (the run's format)."""
        ctx = self._ctx
        for k, model in enumerate(ctx.models):
            if k == 0 or k in ctx.owners:
                self._ran_hooks[k] = model.register_forward_pre_hook(functools.partial(self._note_call, k))
                self._handles.append(self._ran_hooks[k])

    def _note_call(self, index: int, module: nn.Module, args: Any) -> None:
        self._guard("watch", self._called, index=index)

    def _called(self, index: int) -> None:
        handle = self._ran_hooks.pop(index, None)
        if handle is not None:
            handle.remove()   # safe in a hook: torch calls a copy of the hook list
        self._ctx.ran.add(index)
        device = next((p.device.type for p in self._ctx.params), "cpu")
        if index == 0:   # the watched model's forward names the run's format
            if torch.is_autocast_enabled(device):
                self._autocast = dtype_name(torch.get_autocast_dtype(device))
            self._formats = run_formats(self._scaled, self.param_dtypes, self._autocast)   # chosen once

    def _open_recorder(self) -> None:
        from ampdoctor.ranks.info import from_environment, from_process_group

        ranked = from_process_group() or from_environment()
        params = [{"name": n, "module": m, "dtype": d, "shape": list(p.shape)} for n, m, d, p in
                  zip(self.param_names, self.param_modules, self.param_dtypes, self._ctx.params)]
        self._recorder = FlightRecorder(self.log_dir, log_header(
            self._optimizer, self._scaler, every=self.every, stats=self.stats, sample=self.sample, params=params),
            rank=ranked.rank if ranked else None, world_size=ranked.world_size if ranked else None, fsync=self.fsync)

    def detach(self) -> None:
        """Flush what is pending, remove every hook, close the log and drop references to the training objects."""
        if self._optimizer is None:
            return
        if self.attached and "watch" not in self._aside.off:
            self._guard("watch", self._flush, partial=True)
        # Every handle of every part goes, failed parts included; detach() itself never raises.
        handles, self._handles = self._handles, []
        for handle in reversed(handles):  # last installed first: restores the scaler exactly
            call_safely(handle.remove)
        for part in self._parts:
            call_safely(part.detach, on_error=functools.partial(self._fail, part.name))
        if self._recorder is not None:
            self._guard("recorder", self._close_recorder)
        self._model = self._optimizer = self._scaler = self._loss_scaler = self._stepper = self._ctx = None
        self._chain = []
        self.attached = False

    def _close_recorder(self) -> None:
        summary = self.watch_summary()   # the findings too: a watch-only log is whole
        self._recorder.close({"steps": self.steps, "summary": summary.to_dict(), "environment": environment(),
                              "findings": self._findings(summary)})

    def __enter__(self) -> "Watch":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ---- the step clock -------------------------------------------------------------------------------------------
    def _before_scaler_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if not steps_through(optimizer, self._chain):
            return
        self._through_scaler = True   # this step ends at update(), not at the optimizer's post-hook
        if self._discarded_now() or not self._sampled_now:
            return
        scaler = self._scaler  # its stage is kept for the object it is given, wrapper or not
        self._read_point(live_scale(scaler), scaled=stage(scaler, optimizer) is OptState.READY)

    def _end_skipped_steps(self, loss_scaler: Any) -> Any:
        """Observe the decision of a library's loss scaler: a skip ends the step, since the optimizer does not step
        (after the loss scale's part, whose observer this one wraps, recorded it). Return the handle."""
        shape = loss_scaler_shape(loss_scaler)

        def returned(result: Any, *args: Any, **kwargs: Any) -> None:
            if shape.skipped(args, kwargs, result, None):
                self._step_done()

        def raised(exc: BaseException, *args: Any, **kwargs: Any) -> None:
            if shape.skipped(args, kwargs, None, exc):   # fairseq's OverflowError, or the FloatingPointError that
                self._step_done()                        # stops the run at its minimum scale

        return observe(loss_scaler, shape.method, after=returned, raised=raised,
                       on_error=lambda e: self._fail("watch", e))

    def _discarded_now(self) -> bool:
        """The step starts: tell the parts; whether the gradients of its backward calls were reset before it
        (zero_grad() between backward() and step()). Those are not read: what the step finds is not what backward
        computed, and AMP612 says what happened."""
        return any([self._aside.guard(part.name, part.step_starting) for part in self._active()])

    def _optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if self._discarded_now() or not self._sampled_now:
            return None
        if self._scaler is not None and (self._through_scaler or live_scale(self._scaler) is not None):
            # read in scaler.step(); or a direct step after scale(): whether its gradients carry the scale is unknown
            return None
        # A GradScaler we were not given sets grad_scale on a fused optimizer: its grads are still scaled.
        grad_scale = getattr(optimizer, "grad_scale", None)
        scaled = isinstance(grad_scale, torch.Tensor)
        read = functools.partial(self._read_point, grad_scale if scaled else None, scaled)
        # step(closure) (Lightning, LBFGS) computes the gradients inside the step: read them when it returns
        wrapped = closure_calls_back(args, kwargs, lambda: call_safely(read))
        if wrapped is None:
            read()
        return wrapped

    def _read_point(self, scale: torch.Tensor | None, scaled: bool) -> None:
        for part in self._active():
            self._aside.guard(part.name, part.read_point, scale, scaled)

    def follows(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` is the one this watch follows (as given, or one it wraps)."""
        return any(o is optimizer for o in self._chain)

    def count_every_loss(self, hidden_by: str) -> None:
        """Check every loss given to backward for inf/NaN, sampled step or not (AMP610): where the run's log leaves
        them out, ``hidden_by`` names what does (``"TrainingArguments(logging_nan_inf_filter=True)"``)."""
        for part in self._active():
            self._aside.guard(part.name, part.count_every_loss, hidden_by)

    def read_step(self, optimizer: Any) -> None:
        """Read the gradients of the step of ``optimizer`` that is under way now: the watch attached inside it, after
        its pre-hooks ran (``ampdoctor run`` finds the model in a ``step(closure)``'s forward)."""
        self._optimizer_pre_hook(optimizer, (), {})

    def note_clip(self, total_norm: Any, scaled: bool = False) -> None:
        """Record a clip's returned (pre-clip) norm on a sampled step; ``scaled``: it clipped before unscale_."""
        if self._sampled_now:  # other steps do no device work for it
            for part in self._active():
                self._aside.guard(part.name, part.clipped, total_norm, scaled)

    def _after_update(self, *args: Any, **kwargs: Any) -> None:
        """``scaler.update()`` returned: the end of the step, unless it ended already at a direct
        ``optimizer.step()`` the scaler took no part in (``update(new_scale)`` after it: one step, not two)."""
        through, self._through_scaler = self._through_scaler, False
        ended, self._ended_directly = self._ended_directly, False
        self._updated = True
        if through or not ended:
            self._step_done()

    def _after_direct_step(self, *args: Any, **kwargs: Any) -> None:
        """With a GradScaler, the optimizer's post-hook. Until the scaler's first ``update()``, a step it took no
        part in (``optimizer.step()`` called directly, no ``scaler.step()`` or ``unscale_()`` of it since) ends
        here: AMP412's loop, or a scaler never used, calls no ``update()``. Once ``update()`` runs, it ends every
        step, as the ``ScaleMonitor``'s and the guard's steps do (a second optimizer stepped without the scaler)."""
        if self._updated:
            return
        took_part = call_safely(lambda: self._through_scaler or any(
            stage(self._scaler, o) is not OptState.READY for o in self._chain), on_error=lambda e: self._fail(
            "watch", e))
        if took_part is False:   # None: the check failed; the step is left to update()
            self._ended_directly = True
            self._step_done()

    def _step_done(self, *args: Any, **kwargs: Any) -> None:
        """The end of a step: ``scaler.update()`` returned, or the optimizer step post-hook (without a scaler, or a
        step the scaler took no part in)."""
        if "watch" in self._aside.off:
            if self._sampled_now:   # the other ranks' collectives still need this one's
                self._parts_ending()
            self.steps += 1  # the watch is off, but the steps still count (O(1), nothing else)
            for part in self._parts:
                call_safely(part.step_ended)
            self._sampled_now = self._sampling.sampled(self.steps)
            return
        self._guard("watch", self._end_step)

    def _end_step(self) -> None:
        start = time.perf_counter()
        try:
            self._consume()  # the last sampled step's copy (CUDA): the device has finished it by now
            if self._sampled_now:
                self._flush()
        finally:  # a failing flush (reported by the caller) still ends the step
            self.steps += 1
            for part in self._active():
                self._aside.guard(part.name, part.step_ended)
            self._seconds += time.perf_counter() - start
        self._set_sampling(self._sampling.sampled(self.steps))

    def _set_sampling(self, active: bool) -> None:
        self._sampled_now = active
        for part in self._active():
            self._aside.guard(part.name, part.set_sampling, active)

    def _parts_ending(self) -> None:
        """Every rank, every sampled step, every part, off or not: a part's collectives are shared by the ranks."""
        for part in self._parts:
            call_safely(part.sampled_step_ending, on_error=functools.partial(self._fail, part.name))

    # ---- the one host copy of a sampled step ----------------------------------------------------------------------
    def _flush(self, partial: bool = False) -> None:
        """The one host sync of a sampled step: copy every part's device values to the host, then consume them."""
        self._consume()  # the previous sampled step's copy, if it is still pending
        if not partial:
            self._parts_ending()
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for part in self._active():
            values = self._aside.guard(part.name, part.pending, partial)
            if values is not None:
                pending[part.name] = values
        if partial and not any(part.news(pending[part.name]) for part in self._active() if part.name in pending):
            return  # detached right after a sampled step: nothing new
        copy = HostCopy(pending, self.reads)  # started (and counted) here; read now on CPU, after the next step on CUDA
        step = self.steps - 1 if partial else self.steps  # partial: written at detach, after the last step
        entries: dict[str, Any] = {}  # the step line's entries, by their keys
        for part in self._active():   # read at once: a non-finite output is re-run before the next step moves weights
            if part.immediate and part.name in pending:
                host = copy.values()[part.name] if pending[part.name] else {}
                self._aside.guard(part.name, lambda p=part, h=host: entries.update(p.consume(h, Reading(
                    step, partial, entries))))
        self._deferred = (copy, step, round(time.perf_counter() - self._started, 4), entries, partial)
        # deferred only when the next step is sampled too: escalation needs the values (test_deferred_read.py)
        if not copy.deferred or partial or not self._sampling.sampled(step + 1):
            self._consume()

    def _consume(self) -> None:
        """Read a sampled step's host copy (on CUDA at the end of the next step), record it, raise the alarms."""
        if self._deferred is None:
            return
        (copy, step, t, entries, partial), self._deferred = self._deferred, None
        host = copy.values()
        reading = Reading(step, partial, entries)
        for part in self._active():   # in order: a part reads the entries of the ones before it
            if not part.immediate and part.name in host:
                self._aside.guard(part.name, lambda p=part: entries.update(p.consume(host[p.name], reading)))
        record = step_line(step, t, partial=partial, **entries)
        view = read_step(record)
        for part in self._active():
            self._aside.guard(part.name, part.check, view, partial)
        if not partial:
            self._guard("watch", self._escalate, view, step)
            self.sampled_steps += 1
        self.last_record = record
        if self._recorder is not None:
            self._guard("recorder", self._recorder.write, record)

    def _escalate(self, record: Any, step: int) -> None:
        """After the first skip or non-finite gradient: sample the next steps, and tell the parts (the activation
        look arms itself for them)."""
        escalated = self._sampling.escalate(record, step)
        if any(part.collective for part in self._parts):   # the sampled steps, and so the collectives, must follow
            self._sampling.escalated_at = None              # the step count alone
        if escalated:
            for part in self._active():
                self._aside.guard(part.name, part.trouble, self.steps + 1)

    # ---- isolation ------------------------------------------------------------------------------------------------
    def _active(self) -> list[WatchPart]:
        """The parts not switched off, in order."""
        off = self._aside.off
        return [part for part in self._parts if part.name not in off]

    def _guard(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._aside.guard(part, fn, *args, **kwargs)

    def _fail(self, part: str, exc: BaseException) -> None:
        """Report an internal error of ``part`` once (AMP001) and switch that part off; training is untouched."""
        self._aside.fail(part, exc)

    def _stop(self, name: str) -> None:
        """Switch a part off without removing observers: removing a patch that another one wraps would leave it
        behind, and torch iterates over the hook dicts live during ``step()``; detach() removes everything in
        reverse order. ``watch`` (the step bookkeeping) takes every part with it; the recorder closes."""
        if name == "recorder" and self._recorder is not None:
            call_safely(self._recorder.close)
        for part in self._parts:
            if part.name == name or name == "watch":
                call_safely(part.stop)

    # ---- results: the summary, findings, report -------------------------------------------------------------------
    @property
    def formats(self) -> list[str]:
        """The formats the run is measured in (``core.formats.run_formats``): chosen once, at the watched model's
        first forward (its autocast), from the GradScaler and the parameters' dtypes; every view shows these."""
        return self._formats or run_formats(self._scaled, self.param_dtypes, self._autocast)

    def watch_summary(self) -> WatchSummary:
        """Return the summary: the watch's own numbers, every part's section, and what the invariants verified."""
        own = dict(steps=self.steps, sampled_steps=self.sampled_steps, every=self.every, stats=self.stats,
                   sample=self.sample, host_syncs=self.host_syncs, log_path=self.log_path,
                   seconds_inside=round(self.seconds_inside, 6), formats=tuple(self.formats))
        sections: dict[str, Any] = {}
        for part in self._parts:   # a part that is off keeps its results
            sections.update(call_safely(part.sections, on_error=functools.partial(self._fail, part.name)) or {})
        built_in = {key: sections.pop(key, None) for key in _SECTIONS}
        summary = WatchSummary(**own, **{**built_in, "gradients": built_in["gradients"] or GradientSummary()},
                               parts={k: v for k, v in sections.items() if v is not None},
                               off=tuple(sorted(self._aside.off)))
        return replace(summary, verified=verified(summary))

    def summary_data(self) -> dict[str, Any]:
        """Return the JSON-ready summary (``Report.extra["watch"]`` as the JSON report writes it)."""
        return self.watch_summary().to_dict()

    @property
    def host_syncs(self) -> int:
        """Device-to-host reads made by the watch and its parts: the sampled steps' copies, the activation monitor's."""
        return self.reads.count

    @property
    def log_path(self) -> str | None:
        """The flight recorder's file, if any."""
        return None if self._recorder is None else str(self._recorder.path)

    def part(self, name: str) -> Any:
        """Return the part named ``name`` (``monitor.part.WatchPart``), None when the watch has none."""
        return next((part for part in self._parts if part.name == name), None)

    @property
    def last_grads(self) -> dict[str, dict[str, float]]:
        """The per-parameter gradient statistics of the last sampled step, by parameter name."""
        gradients = self.part("gradients")
        return {} if gradients is None else gradients.reader.last

    @property
    def norm_history(self) -> list[tuple[int, float]]:
        """``(step, global gradient norm)`` of the sampled steps, up to 10_000."""
        gradients = self.part("gradients")
        return [] if gradients is None else gradients.reader.norm_history

    def findings(self) -> list[Finding]:
        """Return the findings so far: every part's, the invariants' (``monitor.verdicts``), AMP001."""
        return self._findings(self.watch_summary())

    def _findings(self, summary: WatchSummary) -> list[Finding]:
        found = [f for part in self._parts for f in call_safely(
            part.findings, summary, on_error=functools.partial(self._fail, part.name)) or []]
        invariants = call_safely(invariant_findings, summary, on_error=functools.partial(self._fail,
                                                                                       "invariants")) or []
        return watch_findings(summary, list(self._aside.findings) + found, invariants)

    def summary(self, findings: bool = True) -> WatchView:
        """Return the summary and (unless ``findings=False``) the findings, for ``rich.print``."""
        summary = self.watch_summary()
        return WatchView(summary, self._findings(summary) if findings else None)

    def report(self) -> Report:
        """Return an ``ampdoctor.core.report.Report`` with the findings and ``extra={"watch": the summary}``."""
        summary = self.watch_summary()
        report = Report(extra={"watch": summary})   # device facts are read when it is shown
        list(map(report.add, self._findings(summary)))
        return report
