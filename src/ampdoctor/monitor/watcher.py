"""Watch the numerics of a training run: gradient statistics, loss scale, lost updates and activations.

Where and when things are read. Gradients, lost updates and activations are looked at on sampled steps (the first
ten, then every ``every``-th, and more after trouble: ``ampdoctor.monitor.sampling``); the loss scale on every step:

* **Gradients**, on a sampled step, just before ``scaler.step(optimizer)`` (observed, pass-through) with an enabled
  GradScaler, else in an optimizer step pre-hook (or when a ``step(closure)``'s closure returns; also with a
  GradScaler that never scaled a loss). The grads are then final (clipped, if the loop clips) and not yet
  consumed; the scaler's stage for this optimizer (or the ``optimizer.grad_scale`` it sets for fused optimizers,
  which unscale ``.grad`` in place in their kernel) says whether they still carry the loss scale.
* **Loss scale and skipped steps** on every step, on the device (``ScaleMonitor``, around ``scaler.update``).
* **Updates** around the optimizer step of a sampled step: lost to rounding, moved, weights finite
  (``UpdateMonitor``).
* **The loss and dropped iterations** at every backward (``BackwardMonitor``: O(1) host work per call).
* **Invariants** of training health from all of it when the findings are read (``monitor.invariants``).
* **Activations** (``activations=True``): ``ActivationMonitor`` hooks, switched on for sampled steps. Without it,
  one is armed for the dense start (the first ``dense`` steps) and for the step after trouble, to name the first
  module with an inf/NaN output (AMP601/AMP609 only): a script that stops at its first NaN loss has no later step.

Wrapped optimizers (accelerate's, ``MasterWeights``, DeepSpeed's, stacked) are seen through: ``monitor.watched``. A step
ends when ``scaler.update()`` returns (without a scaler: ``optimizer.step()``, or a DeepSpeed optimizer's ``step()``,
which steps it once per group; with one, also a direct ``optimizer.step()`` it took no part in before its first
``update()``: AMP412's loop, or a scaler never used, calls none). A sampled step copies the monitors' device
tensors to the host in one read (at once on CPU, after the next step on CUDA: ``monitor.host_sync``), the
activation monitor's in one more (``host_syncs`` counts every read: ``core.host_reads``); sharded gradients are
merged over their ranks first (``monitor.reduction``).

Do no harm: nothing here writes to parameters, gradients, optimizer or scaler state, or the global RNG; ``detach()``
removes every hook and drops the references. An internal exception is reported once as AMP001 and that part stops.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ampdoctor._torch.distributed import fsdp1_layouts, param_layout
from ampdoctor._torch.modules import delegate_of
from ampdoctor._torch.scaler import OptState, is_enabled, live_scale, stage
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.environment import environment
from ampdoctor.core.findings import Finding
from ampdoctor.core.host_reads import HostReads
from ampdoctor.core.isolation import call_safely
from ampdoctor.core.names import Names
from ampdoctor.core.options import check_every
from ampdoctor.core.patch import observe
from ampdoctor.core.records import Step, read_step, step_line
from ampdoctor.core.report import Report
from ampdoctor.core.views import Drawn
from ampdoctor.explanations.fixes import nonfinite_grads_fix
from ampdoctor.monitor.activation_records import is_input
from ampdoctor.monitor.averages import AverageMonitor, average_findings
from ampdoctor.monitor.backward import BackwardMonitor
from ampdoctor.monitor.gradients import SUBNORMAL_FRACTION, UNDERFLOW_FRACTION, GradientReader, gradient_alarms
from ampdoctor.monitor.host_sync import HostCopy
from ampdoctor.monitor.invariants import invariant_findings, verified
from ampdoctor.monitor.loss_scale import ScaleMonitor
from ampdoctor.monitor.parts import WatchParts
from ampdoctor.monitor.recorder import FlightRecorder
from ampdoctor.monitor.sampling import DENSE_STEPS, Sampling
from ampdoctor.monitor.summary import log_header, run_formats
from ampdoctor.monitor.updates import UpdateMonitor
from ampdoctor.monitor.watched import (
    EngineCopies,
    closure_calls_back,
    name_params,
    other_models,
    param_owners,
    refuse_meta,
    scaler_of,
    steps_through,
    watched_chain,
)

__all__ = ["watch", "Watch", "WatchView", "STATS", "UNDERFLOW_FRACTION", "SUBNORMAL_FRACTION", "armed_findings"]

STATS = ("norms", "full", "exact")  # what GradStats computes: see Watch (AMP605 thresholds: monitor.gradients)


# What a monitor armed for one step reports: the first inf/NaN output or input. Its headroom (AMP606) and inf
# output gradients (AMP602, what a GradScaler's skips are for) are left to a watch with activations=True.
ARMED_CODES = ("AMP601", "AMP609")


def armed_findings(monitor: Any) -> list[Finding]:
    """Return the findings of an ``ActivationMonitor`` armed for one step (see ``ARMED_CODES``)."""
    return [f for f in monitor.findings() if f.code in ARMED_CODES]


@dataclass(frozen=True)
class WatchView(Drawn):
    """A watch's summary to show (``rich.print(w.summary())``; drawn by ``ampdoctor.ui.watch_view``).

    Attributes:
        summary: ``Watch.summary_data()``.
        findings: the watch's findings to list under it; ``[]``: say the verdict; None: shown elsewhere.
    """

    summary: dict[str, Any]
    findings: list[Finding] | None = None


def watch(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None, *, every: int = 50,
          log_dir: str | None = None, activations: bool = False, stats: str = "full", sample: int = 4096,
          fsync: bool = False, dense: int = DENSE_STEPS) -> "Watch":
    """Attach a :class:`Watch` to a training loop and return it; use it as a context manager or call ``detach()``.

    >>> model = nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with watch(model, opt, every=1) as w:
    ...     model(torch.ones(3, 4)).sum().backward(); opt.step()
    >>> w.steps, w.host_syncs   # the step's one copy (with the activation monitor's values, armed for the dense start)
    (1, 1)
    """
    return Watch(model, optimizer, scaler, every=every, log_dir=log_dir, activations=activations, stats=stats,
                 sample=sample, fsync=fsync, dense=dense).attach()


class Watch:
    """The numerics watch of one model, its optimizer and (optionally) its GradScaler.

    Args:
        model: the module being trained (used for parameter and module names, and activation hooks).
        optimizer: the optimizer stepping it, or a wrapper that delegates to one (accelerate's, ``MasterWeights``);
            the statistics cover its parameters.
        scaler: the ``torch.amp.GradScaler``, if any (default: an ``AcceleratedOptimizer``'s). A disabled one is none.
        every: look closely at every ``every``-th optimizer step (step 0 first); 1 = every step.
        dense: also look closely at each of the first ``dense`` steps (see ``ampdoctor.monitor.sampling``).
        log_dir: write the JSON-lines flight recorder ``ampdoctor.jsonl`` there (or to this ``.jsonl`` file).
        activations: also run ``ActivationMonitor`` (first non-finite module, fp16 headroom) on sampled steps.
        stats: ``"norms"`` (L2 and abs-max), ``"full"`` (everything; counts from ``sample`` entries per
            parameter, exact for smaller ones) or ``"exact"`` (every count over every entry; slow).
        sample: entries per parameter for the counts and the lost-update snapshots (of a parameter wider than
            fp16/bf16, at most ``monitor.updates.MOVED_SAMPLE``: its lost updates are not counted).
        fsync: fsync the log after every line (see ``ampdoctor.monitor.recorder``).
        others: other models the optimizer may also train, to name their parameters (``ampdoctor run``'s).
        frozen: returns the models that ran a forward with nothing to train (a teacher, a VAE; ``ampdoctor run``'s):
            the look at the forward covers them and ``others`` (``ActivationMonitor``'s ``others``).
        names: how the run names what the script holds (``core.names.Names``; a watch alone has its own).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None, *, every: int = 50,
                 log_dir: str | None = None, activations: bool = False, stats: str = "full", sample: int = 4096,
                 fsync: bool = False, dense: int = DENSE_STEPS, others: Sequence[nn.Module] = (),
                 frozen: Callable[[], Sequence[nn.Module]] | None = None, names: Names | None = None) -> None:
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
        self._scaler = scaler_of(chain, scaler)  # None: an AcceleratedOptimizer's, if it holds one
        self._want_activations = activations
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._names = names or Names()   # the run's (``core.names``): the script's names for its models
        self.param_names, self.param_modules, self.param_dtypes, self._prefix = name_params(model, params, others,
                                                                                            optimizer, self._names)
        self._params: list[torch.Tensor] = params
        # The models the watched tensors belong to (``model`` first), while attached, and each tensor's (None: no
        # model's). AMP617 counts the tensors of the models this run trains (a forward ran while watched, or one of
        # their tensors got a gradient), not those of a model the script replaced (a resume, a re-run cell).
        self._models: list[nn.Module] = [model, *[m for m in others if m is not model]]
        self._others, self._frozen = list(others), frozen   # for the look at the forward: other_models
        self._owners = param_owners(self._models, params)
        self._ran: set[int] = set()   # models (by index in _models) whose forward ran while watched
        self._ran_hooks: dict[int, Any] = {}
        copies = EngineCopies([*chain, model], params, self.param_names, self.param_modules, optimizer)
        self._stepper = copies.stepper  # sharded gradients are merged over their ranks: ampdoctor.monitor.reduction
        layouts = {**fsdp1_layouts(model), **copies.layouts}
        self._grads = GradientReader(params, self.param_names, stats=stats, sample=sample,
                                     layouts=[param_layout(p, layouts) for p in params], padding=copies.padding)
        self._grads.unsummarised.update({} if params else {type(optimizer).__name__: copies.why_empty()})  # say why
        self.steps = 0  # completed optimizer steps (scaler.update() calls with a scaler, and direct steps)
        self._through_scaler = False   # scaler.step() of the watched optimizer since the last update()
        self._ended_directly = False   # a step ended at a direct optimizer.step() since the last update()
        self._updated = False          # scaler.update() returned once: from then on it ends every step
        self.sampled_steps = 0
        self.reads = HostReads("watch")  # every host read of the watch and its parts: host_syncs (core.host_reads)
        # seconds spent computing statistics and closing steps (sync, record, log line), and in the forward hooks of
        # activation monitors gone (disarmed); with the lost-update hooks' and the current activation monitor's own
        # (seconds_inside). The O(1) per-step observers and the output-gradient probes are not in it
        self._seconds = 0.0
        self.last_record: dict[str, Any] | None = None
        self._sampled_now = True
        self._sampling, self._armed = Sampling(every, dense), None  # _armed: an ActivationMonitor, its last step
        self._handles: list[Any] = []
        self._scale_monitor: ScaleMonitor | None = None
        self._lost: UpdateMonitor | None = None
        self._backward: BackwardMonitor | None = None
        self._averages: AverageMonitor | None = None
        self._autocast: str | None = None   # the autocast dtype of the model's first forward after attach, if any
        self._activations: Any = None
        self._activation_result: tuple[dict[str, Any], list[Finding]] | None = None
        # the activation monitor's looks at the forward of sampled steps whose loss was inf/NaN: [step, the first
        # module with a non-finite output ("(input)": the model's input; None: every output finite)], up to 20
        self._bad_loss_forwards: list[list[Any]] = []
        self._recorder: FlightRecorder | None = None
        self._deferred: tuple[HostCopy, int, float, dict[str, Any], bool] | None = None  # a step's copy, not read
        self._parts = WatchParts()
        self._started = time.perf_counter()
        self.attached = False

    @property
    def seconds_inside(self) -> float:
        """Seconds spent inside the watch: statistics, the ends of steps, the lost-update hooks and the activation
        monitor's forward hooks."""
        return self._seconds + sum(part.seconds for part in (self._lost, self._activations) if part is not None)

    # ---- attaching ------------------------------------------------------------------------------------------
    def attach(self) -> "Watch":
        """Register every hook and observer; return ``self``. Attaching twice is a no-op."""
        if self.attached or self._optimizer is None:
            return self
        opt, scaler = self._optimizer, self._scaler
        self.attached = True
        try:  # the lost-update hooks first: without a scaler the step ends in our post-hook, after theirs
            named = list(zip(self.param_names, self._params))
            self._lost = UpdateMonitor(named, sample=self.sample, on_error=lambda e: self._fail("lost_updates", e))
            self._lost.attach(opt)
            # the probe may be a model parameter the optimizer does not hold (a hand-written fp32 master copy)
            probes = [*self._params, *(self._model.parameters() if self._model is not None else ())]
            owners = [*self._chain, self._model]   # whose zero_grad() resets the watched gradients
            while owners[-1] is not None and len(owners) < len(self._chain) + 4:   # the model inside DDP, compile
                owners.append(delegate_of(owners[-1]))
            self._backward = BackwardMonitor(probes, scaler, on_error=lambda e: self._fail("loss", e),
                                             owners=owners).attach()
            if scaler is not None:
                self._scale_monitor = ScaleMonitor(scaler, capacity=min(self.every, 1024),
                                                   on_error=lambda e: self._fail("scale", e)).attach()
                # installed after ScaleMonitor's: ours wraps it, so the step ends after its observer ran
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
            self._guard("averages", self._attach_averages)
            # once per model: that its forward ran, and the model's forward's autocast dtype (the run's format)
            for k, model in enumerate(self._models):
                if k == 0 or k in self._owners:
                    self._ran_hooks[k] = model.register_forward_pre_hook(functools.partial(self._note_call, k))
                    self._handles.append(self._ran_hooks[k])
            if self._want_activations:
                self._guard("activations", self._attach_activations)
            elif self._sampling.dense:
                self._guard("activations", lambda: self._arm_activations(self._sampling.dense - 1))
            if self.log_dir is not None:  # an unwritable log_dir must not stop the training: AMP001 says so
                self._guard("recorder", self._open_recorder)
            self._set_sampling(self._sampling.sampled(self.steps))
        except Exception:
            self.detach()
            raise
        return self

    def _note_call(self, index: int, module: nn.Module, args: Any) -> None:
        self._guard("watch", self._called, index=index)

    def _called(self, index: int) -> None:
        handle = self._ran_hooks.pop(index, None)
        if handle is not None:
            handle.remove()   # safe in a hook: torch calls a copy of the hook list
        self._ran.add(index)
        device = next((p.device.type for p in self._params), "cpu")
        if index == 0 and torch.is_autocast_enabled(device):   # the watched model's forward names the run's format
            self._autocast = dtype_name(torch.get_autocast_dtype(device))

    def _attach_averages(self) -> None:
        self._averages = AverageMonitor(self.every, sample=self.sample, reads=self.reads,
                                        on_error=lambda e: self._fail("averages", e)).attach()

    def _attach_activations(self, gradients: bool = True) -> None:
        from ampdoctor.monitor.activations import ActivationMonitor
        # the run's other models too: the first inf/NaN in call order may be theirs (a GAN's generator), and an input
        # of the watched model that one of them made inf is no bad data
        frozen = list(self._frozen()) if self._frozen is not None else []
        others = other_models(self._model, self._others, frozen, self._names) \
            if len(self._models) > 1 or frozen else []
        self._activations = ActivationMonitor(self._model, reads=self.reads, setup=SimpleNamespace(scaler=self._scaler),
                                              gradients=gradients, prefix=self._prefix, others=others)
        self._activations.attach()

    def _arm_activations(self, last: int) -> None:
        """Hook the sampled steps up to ``last``; the record of each is read at its end (or at detach). Armed, the
        monitor looks at the forward alone: its findings are the first non-finite output or input (ARMED_CODES)."""
        self._attach_activations(gradients=False)
        self._armed = (self._activations, last)

    def _disarm(self) -> None:
        armed, self._armed, self._activations = self._armed[0], None, None
        self._activation_result = (armed.summary(), armed_findings(armed))
        self._seconds += armed.seconds
        armed.detach()

    def _open_recorder(self) -> None:
        params = [{"name": n, "module": m, "dtype": d, "shape": list(p.shape)} for n, m, d, p in
                  zip(self.param_names, self.param_modules, self.param_dtypes, self._params)]
        self._recorder = FlightRecorder(self.log_dir, log_header(
            self._optimizer, self._scaler, every=self.every, stats=self.stats, sample=self.sample, params=params),
            fsync=self.fsync)

    def detach(self) -> None:
        """Flush what is pending, remove every hook, close the log and drop references to the training objects."""
        if self._optimizer is None:
            return
        if self.attached and "watch" not in self._parts.off:
            self._guard("watch", self._flush, partial=True)
        # Every handle of every part goes, failed parts included; detach() itself never raises.
        handles, self._handles = self._handles, []
        for handle in reversed(handles):  # last installed first: restores the scaler exactly
            call_safely(handle.remove)
        for monitor in (self._scale_monitor, self._lost, self._backward, self._averages):
            if monitor is not None:
                call_safely(monitor.detach)
        if self._activations is not None:
            activations = self._activations
            if "activations" not in self._parts.off:
                self._guard("activations", activations.detach)  # records the pending step, removes the hooks
            call_safely(activations._remove_hooks)  # a part that is off keeps no hook either
            keep = armed_findings if self._armed else lambda monitor: monitor.findings()
            self._activation_result = call_safely(lambda: (activations.summary(), keep(activations)))
            self._seconds += activations.seconds
            self._activations = self._armed = None
        if self._recorder is not None:
            self._guard("recorder", lambda: self._recorder.close({  # findings too: a watch-only log is whole
                "steps": self.steps, "summary": self.summary_data(), "environment": environment(),
                "findings": self.findings()}))
        self._model = self._optimizer = self._scaler = self._stepper = None
        self._chain, self._params, self._models, self._others, self._frozen = [], [], [], [], None
        self._grads.release()
        self.attached = False

    def __enter__(self) -> "Watch":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ---- hooks ----------------------------------------------------------------------------------------------
    def _before_scaler_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if not steps_through(optimizer, self._chain):
            return
        self._through_scaler = True   # this step ends at update(), not at the optimizer's post-hook
        if self._discarded_now() or not self._sampled_now or "gradients" in self._parts.off:
            return
        scaler = self._scaler  # its stage is kept for the object it is given, wrapper or not
        self._read_grads(live_scale(scaler), scaled=stage(scaler, optimizer) is OptState.READY)

    def _discarded_now(self) -> bool:
        """The step starts: tell the backward monitor; whether the gradients of its backward calls were reset
        before it (zero_grad() between backward() and step()). Those are not read: what the step finds is not
        what backward computed, and AMP612 says what happened."""
        backward = self._backward
        if backward is None:
            return False
        self._guard("loss", backward.step_started)
        return backward.step_discarded

    def _optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if self._discarded_now() or not self._sampled_now or "gradients" in self._parts.off:
            return None
        if self._scaler is not None and (self._through_scaler or live_scale(self._scaler) is not None):
            # read in scaler.step(); or a direct step after scale(): whether its gradients carry the scale is unknown
            return None
        # A GradScaler we were not given sets grad_scale on a fused optimizer: its grads are still scaled.
        grad_scale = getattr(optimizer, "grad_scale", None)
        scaled = isinstance(grad_scale, torch.Tensor)
        read = lambda: self._read_grads(grad_scale if scaled else None, scaled=scaled)  # noqa: E731
        # step(closure) (Lightning, LBFGS) computes the gradients inside the step: read them when it returns
        wrapped = closure_calls_back(args, kwargs, lambda: self._guard("gradients", read))
        if wrapped is None:
            self._guard("gradients", read)
        return wrapped

    def follows(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` is the one this watch follows (as given, or one it wraps)."""
        return any(o is optimizer for o in self._chain)

    def count_every_loss(self, hidden_by: str) -> None:
        """Check every loss given to backward for inf/NaN, sampled step or not (AMP610): where the run's log leaves
        them out, ``hidden_by`` names what does (``"TrainingArguments(logging_nan_inf_filter=True)"``)."""
        if self._backward is not None and "loss" not in self._parts.off:
            self._backward.count_every_loss(hidden_by)

    def read_step(self, optimizer: Any) -> None:
        """Read the gradients of the step of ``optimizer`` that is under way now: the watch attached inside it, after
        its pre-hooks ran (``ampdoctor run`` finds the model in a ``step(closure)``'s forward)."""
        self._optimizer_pre_hook(optimizer, (), {})

    def note_clip(self, total_norm: Any, scaled: bool = False) -> None:
        """Record a clip's returned (pre-clip) norm on a sampled step; ``scaled``: it clipped before unscale_."""
        if self._sampled_now:  # other steps do no device work for it
            self._guard("gradients", lambda: self._grads.note_clip(total_norm, scaled))

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
        if "watch" in self._parts.off:
            if self._sampled_now and self._grads.reduces:  # the other ranks' collectives still need this one
                call_safely(self._grads.finish)
            self.steps += 1  # the watch is off, but the steps still count (O(1), nothing else)
            if self._backward is not None:
                self._backward.step_ended()
            self._sampled_now = self._sampling.sampled(self.steps)
            return
        self._guard("watch", self._end_step)

    def _read_grads(self, scale: torch.Tensor | None, scaled: bool) -> None:
        start = time.perf_counter()
        self._grads.read(scale, scaled)
        self._seconds += time.perf_counter() - start

    # ---- the end of a step ----------------------------------------------------------------------------------
    def _end_step(self) -> None:
        start = time.perf_counter()
        try:
            self._consume()  # the last sampled step's copy (CUDA): the device has finished it by now
            if self._sampled_now:
                self._flush()
        finally:  # a failing flush (reported by the caller) still ends the step
            self.steps += 1
            if self._backward is not None:
                self._backward.step_ended()
            self._seconds += time.perf_counter() - start
        self._set_sampling(self._sampling.sampled(self.steps))

    def _set_sampling(self, active: bool) -> None:
        self._sampled_now = active
        if self._lost is not None and "lost_updates" not in self._parts.off:
            self._lost.set_sampling(active)
        if self._backward is not None:
            self._backward.sampling = active and "loss" not in self._parts.off
        if self._activations is not None and "activations" not in self._parts.off:
            self._guard("activations", lambda: self._activations.set_sampling(active))

    def _flush(self, partial: bool = False) -> None:
        """The one host sync of a sampled step: copy every monitor's device tensors to the host, then consume."""
        self._consume()  # the previous sampled step's copy, if it is still pending
        if not partial:  # every rank, every sampled step, even with "gradients" off: its collectives are shared
            call_safely(self._grads.finish, on_error=lambda e: self._fail("gradients", e))
        parts: dict[str, dict[str, torch.Tensor]] = {}
        if self._grads.pending():
            parts["gradients"] = self._grads.pending()
        if self._scale_monitor is not None and "scale" not in self._parts.off:
            parts["scale"] = self._scale_monitor.pending()
        if self._lost is not None and "lost_updates" not in self._parts.off:
            parts["lost_updates"] = self._lost.pending()
        if self._backward is not None and "loss" not in self._parts.off:
            parts["loss"] = self._backward.pending()
        if partial and not parts.get("gradients") and "counts" not in parts.get("lost_updates", {}) \
                and "steps" not in parts.get("scale", {}) and not parts.get("loss"):
            return  # detached right after a sampled step: nothing new
        looked = self._activations is not None and "activations" not in self._parts.off and not partial
        if looked:  # the activation monitor's values travel in the same copy
            parts["activations"] = self._guard("activations", self._activations.pending) or {}
        copy = HostCopy(parts, self.reads)  # started (and counted) here; read now on CPU, after the next step on CUDA
        self._grads.clear()
        step = self.steps - 1 if partial else self.steps  # partial: written at detach, after the last step
        entries: dict[str, Any] = {}  # the step line's entries, by core.records.step_line's keywords
        if looked:  # read at once: a non-finite output is re-run (monitor.replay) before the next step moves weights
            values = copy.values()["activations"].get("abs_max") if parts["activations"] else None
            self._guard("activations", lambda: entries.update(activations=self._activations.step_record(
                step, values)))
        self._deferred = (copy, step, round(time.perf_counter() - self._started, 4), entries, partial)
        # deferred only when the next step is sampled too: escalation needs the values (test_deferred_read.py)
        if not copy.deferred or partial or not self._sampling.sampled(step + 1):
            self._consume()

    def _consume(self) -> None:
        """Read a sampled step's host copy (on CUDA at the end of the next step), record it, raise alarms."""
        if self._deferred is None:
            return
        (copy, step, t, entries, partial), self._deferred = self._deferred, None
        host = copy.values()
        if "gradients" in host:
            self._guard("gradients", lambda: entries.update(gradients=self._grads.consume(host["gradients"], step)))
        if "scale" in host:
            self._guard("scale", lambda: entries.update(scale=self._scale_monitor.consume(host["scale"])))
        if "lost_updates" in host:
            skipped = step in (entries.get("scale") or {}).get("skipped", ())
            self._guard("lost_updates", lambda: entries.update(zip(
                ("lost_updates", "updates"), self._lost.consume(host["lost_updates"], step, skipped))))
        if "loss" in host:
            self._guard("loss", lambda: entries.update(loss=self._backward.consume(host["loss"], step, partial)))
        record = step_line(step, t, partial=partial, **entries)  # partial: written at detach, for the last steps
        view = read_step(record)
        self._guard("gradients", lambda: self._check_gradients(view, partial))
        if not partial:
            self._guard("watch", lambda: self._note_look(view))
            self._guard("watch", lambda: self._escalate(view, step))
            self.sampled_steps += 1
        self.last_record = record
        if self._recorder is not None and "recorder" not in self._parts.off:
            self._guard("recorder", lambda: self._recorder.write(record))

    def _note_look(self, record: Step) -> None:
        """Keep what the activation monitor saw in this step's forward, for the findings that say where the inf/NaN
        come from: AMP603 on a skipped step, AMP613 (and whether AMP601 explains it) on a step with an inf/NaN loss."""
        looked = record.activations
        if looked is None or not looked.sampled or not looked.inputs:
            return   # no forward seen on this step, or only part of it (the monitor was attached inside it)
        loss = None if record.loss is None else record.loss.value
        if record.skipped and self._scale_monitor is not None and "scale" not in self._parts.off:
            self._scale_monitor.note_forward(looked.nonfinite_module, loss)
        if loss is not None and not math.isfinite(loss) and len(self._bad_loss_forwards) < 20:
            self._bad_loss_forwards.append([record.step, looked.nonfinite_module])

    # ---- escalation -----------------------------------------------------------------------------------------
    def _escalate(self, record: Step, step: int) -> None:
        """After the first skip or non-finite gradient: sample the next steps, arm the activation monitor once."""
        if self._armed is not None and step >= self._armed[1]:  # its last step is recorded: keep what it found
            self._guard("activations", self._disarm)
        escalated = self._sampling.escalate(record, step)
        if self._grads.reduces:  # the sampled steps, and so the collectives, must follow the step count alone
            self._sampling.escalated_at = None
        if escalated and self._activations is None and self._model is not None and "activations" not in self._parts.off:
            self._guard("activations", lambda: self._arm_activations(self.steps + 1))

    # ---- alarms ---------------------------------------------------------------------------------------------
    def _check_gradients(self, record: Step, partial: bool = False) -> None:
        # whether the step was skipped is unknown with the scale part off (its own error) or a step that never
        # ended (partial: read at detach, e.g. after a crash inside it): then no AMP608
        skips = not partial and (self._scaler is None or "scale" not in self._parts.off)
        grads = self._grads
        for alarm in gradient_alarms(record, grads.last_rows, grads.names, scaler=self._scaler is not None,
                                     stats=self.stats, skips_known=skips, own_nonfinite=grads.own_nonfinite):
            # AMP608's own fix unscales with a GradScaler; this run may have none: the fix that fits it
            fix = nonfinite_grads_fix(is_enabled(self._scaler), self.param_dtypes) if alarm[0] == "AMP608" else None
            self._parts.report(alarm[0], alarm[1], alarm[2], record.step, alarm[3], fix=fix)

    def _guard(self, part: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        return self._parts.guard(part, fn, on_fail=self._fail, **kwargs)

    def _fail(self, part: str, exc: BaseException) -> None:
        """Report an internal error of ``part`` once (AMP001) and switch that part off; training is untouched."""
        if not self._parts.fail(part, exc, self.steps):
            return
        # Switch the part off without removing observers: removing a patch that another one wraps would leave it
        # behind; detach() removes everything in reverse order. Lost updates: a flag, not detach(): _fail runs
        # inside optimizer step hooks, and torch iterates over the hook dicts live during step(), so removing a
        # hook here would raise in the user's step().
        if part in ("gradients", "watch"):
            self._grads.clear()
        stops: dict[str, tuple[Any, Callable[[Any], Any]]] = {
            "scale": (self._scale_monitor, lambda m: setattr(m, "disabled", True)),
            "lost_updates": (self._lost, lambda m: m.disable()),
            "loss": (self._backward, lambda m: setattr(m, "disabled", True)),
            "averages": (self._averages, lambda m: setattr(m, "disabled", True)),
            "activations": (self._activations, lambda m: m.set_sampling(False)),
            "recorder": (self._recorder, lambda m: m.close()),
        }
        for name, (monitor, stop) in stops.items():
            if monitor is not None and (part == name or (part == "watch" and name != "recorder")):
                call_safely(stop, monitor)

    # ---- results: findings, summary, report ------------------------------------------------------------------
    def summary_data(self) -> dict[str, Any]:
        """Return the JSON-ready summary (``Report.extra["watch"]``), with what the invariants verified."""
        summary = self._measured()
        summary["verified"] = verified(summary)
        return summary

    def _trained(self) -> list[bool]:
        """Per watched tensor: whether it is part of what this run trains, for AMP617: it got a gradient, or it is
        a parameter of a model whose forward ran while watched or one of whose tensors got a gradient. A tensor of a
        replaced model (an optimizer built before the model was re-created) is not."""
        arrived = self._grads.arrived
        trained = self._ran | {self._owners[k] for k in arrived}
        return [k in arrived or (owner is not None and owner in trained) for k, owner in enumerate(self._owners)]

    def _measured(self) -> dict[str, Any]:
        grads = self._grads.summary(self.param_modules, self._trained())
        activations = self._activations.summary() if self._activations is not None else (
            self._activation_result[0] if self._activation_result else None)
        return {
            "steps": self.steps, "sampled_steps": self.sampled_steps, "every": self.every, "stats": self.stats,
            "sample": self.sample, "host_syncs": self.host_syncs, "log_path": self.log_path,
            "seconds_inside": round(self.seconds_inside, 6), "formats": run_formats(self._scaler, self.param_dtypes,
                                                                          self._autocast),
            "scale": None if self._scale_monitor is None else self._scale_monitor.summary(),
            "gradients": grads,
            "lost_updates": None if self._lost is None or not self._lost.summary()["watched"] else
            self._lost.summary(),
            "activations": activations,
            "updates": None if self._lost is None or not self._lost.names else self._lost.updates_summary(),
            "loss": self._loss_summary(),
            "averages": self._averages_summary(),
            "off": sorted(self._parts.off),
        }

    def _loss_summary(self) -> dict[str, Any] | None:
        if self._backward is None:
            return None
        summary = self._backward.summary()
        if self._bad_loss_forwards:   # what the forward of steps with an inf/NaN loss looked like (AMP613)
            summary["nonfinite_forward"] = [list(look) for look in self._bad_loss_forwards]
        return summary

    def _averages_summary(self) -> list[dict[str, Any]] | None:
        if self._averages is None or "averages" in self._parts.off:
            return None
        return call_safely(self._averages.summary, on_error=lambda e: self._fail("averages", e)) or None

    @property
    def host_syncs(self) -> int:
        """Device-to-host reads made by the watch and its parts: the sampled steps' copies, the activation monitor's."""
        return self.reads.count

    @property
    def log_path(self) -> str | None:
        """The flight recorder's file, if any."""
        return None if self._recorder is None else str(self._recorder.path)

    @property
    def last_grads(self) -> dict[str, dict[str, float]]:
        """The per-parameter gradient statistics of the last sampled step, by parameter name."""
        return self._grads.last

    @property
    def norm_history(self) -> list[tuple[int, float]]:
        """``(step, global gradient norm)`` of the sampled steps, up to 10_000."""
        return self._grads.norm_history

    def findings(self) -> list[Finding]:
        """Return the findings so far: AMP603/604/605/607/608 (and AMP601/602/606 with ``activations=True``)."""
        activation = self._activation_findings()
        culprit = next((f.where for f in activation if f.code == "AMP601"), None)
        out = list(self._parts.findings)
        if self._scale_monitor is not None:
            self._scale_monitor.name_culprit(culprit)
            out += self._scale_monitor.findings()
        if self._lost is not None:
            out += self._lost.findings()
        out += average_findings(self._averages_summary() or [])
        invariants = call_safely(lambda: invariant_findings(self._measured()), on_error=lambda e: self._fail(
            "invariants", e)) or []
        if any(f.code == "AMP612" and f.where == "GradScaler" for f in invariants):
            out = [f for f in out if f.code != "AMP604"]  # every step skipped: said once, as the error it is
        if culprit is not None and self._loss_explained(activation):   # AMP601 says where the loss's starts: once
            invariants = [f for f in invariants if f.code != "AMP613"]
        return out + activation + invariants

    def _loss_explained(self, activation: list[Finding]) -> bool:
        """Whether AMP601 explains the inf/NaN loss: on the first sampled step whose loss was inf/NaN a module's
        output already was (as the look at that forward, or AMP601's own step, shows), and every other step with an
        inf/NaN loss whose forward was looked at had a module's output inf/NaN too (not the input, not none)."""
        bad = (self._backward.summary().get("nonfinite") or []) if self._backward is not None else []
        looks = dict(map(tuple, self._bad_loss_forwards))
        if not bad or any(module is None or is_input(module) for module in looks.values()):
            return False
        # a look at the first bad step that began inside its forward (the watch attached there) is not in `looks`;
        # an AMP601 of that step is the activation monitor's word that a module's output was inf/NaN on it
        return bad[0] in looks or any(f.code == "AMP601" and f.step == bad[0] for f in activation)

    def _activation_findings(self) -> list[Finding]:
        live, kept = self._activations, self._activation_result
        if live is not None:
            return armed_findings(live) if self._armed else live.findings()
        return kept[1] if kept else []

    def summary(self, findings: bool = True) -> WatchView:
        """Return the summary and (unless ``findings=False``) the findings, for ``rich.print``."""
        return WatchView(self.summary_data(), self.findings() if findings else None)

    def report(self) -> Report:
        """Return an ``ampdoctor.core.report.Report`` with the findings and ``extra={"watch": summary_data()}``."""
        report = Report(extra={"watch": self.summary_data()})   # device facts are read when it is shown
        list(map(report.add, self.findings()))
        return report
