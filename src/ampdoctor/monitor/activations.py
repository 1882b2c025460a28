"""Watch every module's outputs and output gradients for inf/NaN, and for headroom below the fp16 maximum.

Cost model. On a sampled step each module's forward hook runs one ``torch.aminmax`` per floating-point output (a
single-pass reduction, no copy, no host sync) and keeps the two 0-d results; outputs that require grad get a
``Tensor.register_hook`` probe that does the same for their gradient during backward. ``step_record()`` stacks
everything and copies it to the host in one sync, then finds the first non-finite value in call order (forward)
and in backward order. On a step that is not sampled every hook returns after one bool check.

Re-run contract. Only when a module's output is non-finite for the first time does the monitor look closer: it
re-runs that forward with hooks that dump abs-min/abs-max frames (like transformers' ``DebugUnderflowOverflow``),
then, unless a weight is already non-finite, once more under :class:`ampdoctor.monitor.op_replay.NonfiniteOpTracer` to
name the ATen op. To do so it keeps references to the root module's positional and keyword inputs of the last
root call of each sampled step, with the autocast and RNG state at that call, and releases them when the step
is recorded. The re-run runs under ``torch.no_grad()`` and the captured autocast state with its weight cache off
(older torch let a ``no_grad`` cast into the user's autocast cache and lose gradients, pytorch#112583), inside
``torch.random.fork_rng`` seeded with the captured state (same dropout masks), and restores every buffer
(BatchNorm statistics) afterwards, so training is bitwise unaffected. Limits: the re-run sees the weights as
they are when the step is recorded (a GradScaler skips the step on inf, so they are unchanged; without one the
optimizer may have stepped), the inputs of the last root call only (gradient accumulation), and it runs others'
forward hooks and Python side effects in ``forward`` once more. A re-run that does not reproduce says so.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ampdoctor.core.findings import Finding, Severity
from ampdoctor.monitor.op_replay import NonfiniteOp, NonfiniteOpTracer, json_float

__all__ = ["ActivationMonitor", "HEADROOM_FACTOR"]

# Flag a module whose output reaches 1/8 of the format's maximum (fp16: 65504 / 8 = 8188). 8 = 2**3 leaves three
# doublings, and each is routinely spent: Dropout(p=0.5) rescales by 1/(1-p) = 2, a residual add of two branches
# of similar size doubles, and activations keep growing as weights grow during training. transformers' T5 dump
# shows exactly this: 6.27e4 out of a Linear, inf out of the Dropout after it.
HEADROOM_FACTOR = 8.0
FRAMES = 5  # frames dumped: the culprit and the modules that ran just before it
MAX_REPLAYS = 3  # re-runs for the first distinct culprits; later ones are reported without frames
MAX_PENDING = 1 << 16  # values held for one step; a driver that never calls step_record() cannot grow memory
_LIMIT_NAMES = {torch.finfo(d).max: str(d).removeprefix("torch.") for d in (torch.bfloat16, torch.float16)}


class ActivationMonitor:
    """Find the first module whose output or output gradient became inf/NaN, and activations near overflow.

    Args:
        model: the module to watch; every submodule from ``model.named_modules()`` gets a forward hook.
        every: standalone sampling: look at every ``every``-th call of ``model`` (1 = every call). A driver
            (``ampdoctor.watch``) calls :meth:`set_sampling` instead.
        setup: the run's ``TrainingSetup``; its scaler is named in gradient findings (gradients are scaled).
        headroom: flag AMP606 when a module's output abs-max exceeds the format's maximum divided by this.
        frames: how many module frames to dump when a forward turns non-finite.

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> with ActivationMonitor(model) as monitor:
    ...     _ = model(torch.ones(2, 4))
    ...     record = monitor.step_record()
    >>> record["sampled"], monitor.first_nonfinite_module
    (True, None)
    """

    def __init__(self, model: nn.Module, *, every: int = 1, setup: Any = None, headroom: float = HEADROOM_FACTOR,
                 frames: int = FRAMES) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}: {model!r:.80}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}; every=1 looks at every step")
        if not headroom > 1:
            raise ValueError(f"headroom must be a factor above 1, got {headroom!r}; the default is {HEADROOM_FACTOR}")
        self._model = weakref.ref(model)
        self.every, self.headroom, self.frames = every, float(headroom), frames
        # the setup holds the model: keep only a weak reference to its scaler, so the monitor never pins the model
        scaler = getattr(setup, "scaler", None)
        self._scaler = weakref.ref(scaler) if scaler is not None else lambda: None
        self.first_nonfinite_module: str | None = None
        self._handles: list[Any] = []
        self._active = False  # the one flag every hook checks
        self._driven = self._broken = self._replaying = False
        self._calls = self._records = self._sampled = self._replays = 0
        self._record: _StepRecord | None = None
        self._findings: list[Finding] = []
        self._reported: set[tuple[str, int]] = set()
        self._first: dict[str, dict[str, Any] | None] = {"forward": None, "backward": None}
        self._error: str | None = None
        self._index_modules(model)

    # ---- attaching ------------------------------------------------------------------------------------------
    def _index_modules(self, model: nn.Module) -> None:
        named = list(model.named_modules())
        self._names = [name or "(root)" for name, _ in named]
        self._classes = [type(m).__name__ for _, m in named]
        position = {id(m): i for i, (_, m) in enumerate(named)}
        self._descendants = [[position[id(d)] for d in m.modules() if d is not m and id(d) in position]
                             for _, m in named]
        self._max_abs: list[float | None] = [None] * len(named)
        self._limit: list[float | None] = [None] * len(named)
        self._nonfinite = [[0, 0] for _ in named]  # steps with a non-finite output, gradient
        devices = {p.device.type for p in model.parameters()} - {"cpu", "meta"}
        self._device_type = min(devices) if devices else None

    def attach(self) -> "ActivationMonitor":
        """Register the hooks; return ``self``. Attaching twice is a no-op."""
        if self._handles or self._broken:
            return self
        model = self._require_model()
        if len(self._names) != sum(1 for _ in model.named_modules()):
            self._index_modules(model)  # the model changed since construction
        for i, (_, module) in enumerate(model.named_modules()):
            self._handles.append(module.register_forward_hook(functools.partial(self._on_forward, i)))
        # prepend: capture the inputs before other pre-hooks (FSDP input casts) change them; the re-run runs them
        self._handles.append(model.register_forward_pre_hook(self._on_root_call, with_kwargs=True, prepend=True))
        return self

    def detach(self) -> None:
        """Record a pending step, then remove every hook this monitor registered."""
        if self._record is not None and not self._broken:
            try:
                self._close(None)
            except Exception as exc:
                self._fail(exc)
        self._remove_hooks()

    def __enter__(self) -> "ActivationMonitor":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    @property
    def enabled(self) -> bool:
        """Whether the hooks are attached and the monitor has not switched itself off."""
        return bool(self._handles) and not self._broken

    def set_sampling(self, active: bool) -> None:
        """Look at the coming step(s) (``True``) or let every hook return at once (``False``)."""
        self._driven = True
        self._active = bool(active) and self.enabled and not self._replaying

    # ---- hooks ----------------------------------------------------------------------------------------------
    def _on_root_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._broken or self._replaying:
            return None
        try:
            if not self._driven:
                if self._record is not None:  # the previous sampled step's backward is done by now
                    self._close(None)
                self._active = self._calls % self.every == 0 and self.enabled
            elif self._record is not None and len(self._record.fwd) > MAX_PENDING:
                self._close(None)
            self._calls += 1
            if self._active:
                self._open().replay = _Replay(args, kwargs, self._device_type)
        except Exception as exc:
            self._fail(exc)
        return None

    def _on_forward(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._active:
            return None
        try:
            self._forward_stats(index, output)
        except Exception as exc:
            self._fail(exc)
        return None

    def _forward_stats(self, index: int, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:  # activation checkpointing recomputes forwards in backward
            return
        rec = self._record if self._record is not None else self._open()
        tensors = (output,) if isinstance(output, torch.Tensor) else [
            t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        for t in tensors:
            if not t.is_floating_point() or t.numel() == 0:
                continue
            version = None if t.is_inference() else t._version
            last = rec.last
            if last is not None and last[0] is t and version is not None and last[1] == version:
                pair, probe = last[2], last[3]  # a container returning its child's output: measured already
            else:
                pair = torch.aminmax(t.detach())  # one pass, no copy; NaN and inf propagate into min/max
                probe = None
                if t.requires_grad and t.grad_fn is not None:  # a leaf (a module returning its own Parameter)
                    probe = _GradProbe(rec)                    # would keep the hook for good: not probed
                    t.register_hook(probe)
                rec.last = (t, version, pair, probe)
            rec.fwd.append(pair)
            rec.fwd_modules.append(index)
            rec.fwd_limits.append(_limit(t))
            if probe is not None:
                probe.modules.append(index)
        if index == 0:
            rec.last = None  # the root's hook runs last: drop the reference to its output

    # ---- recording ------------------------------------------------------------------------------------------
    def _open(self) -> "_StepRecord":
        if self._record is None:
            self._record = _StepRecord(self._records if self._driven else max(self._calls - 1, 0))
        return self._record

    def step_record(self, step: int | None = None) -> dict[str, Any]:
        """Close the current step and return its JSON-ready statistics; this is the monitor's one host sync.

        Call it after ``backward()`` (and the optimizer step). ``step`` overrides the monitor's own count.
        """
        if self._broken:
            return {"step": step, "sampled": False, "error": self._error}
        try:
            return self._close(step)
        except Exception as exc:
            self._fail(exc)
            return {"step": step, "sampled": False, "error": self._error}

    def _close(self, step: int | None) -> dict[str, Any]:
        rec, self._record = self._record, None
        self._records += 1
        if rec is None:
            return {"step": step if step is not None else self._records - 1, "sampled": False}
        rec.closed, rec.last = True, None
        if step is not None:
            rec.step = step
        self._sampled += 1
        fwd, bwd = _abs_max(rec.fwd), _abs_max(rec.bwd)  # the one host sync
        if rec.errors:
            raise rec.errors[0]
        step_max: dict[int, float] = {}
        for i, value, limit in zip(rec.fwd_modules, fwd, rec.fwd_limits):
            if limit is not None:
                self._limit[i] = limit if self._limit[i] is None else min(self._limit[i], limit)
            if math.isfinite(value):
                step_max[i] = max(step_max.get(i, 0.0), value)
                self._max_abs[i] = max(self._max_abs[i] or 0.0, value)
        for i in {i for i, v in zip(rec.fwd_modules, fwd) if not math.isfinite(v)}:
            self._nonfinite[i][0] += 1
        for i in {m[0] for m, v in zip(rec.bwd_modules, bwd) if not math.isfinite(v)}:
            self._nonfinite[i][1] += 1
        worst = self._check_headroom(rec.step, step_max)
        first_fwd = next((k for k, v in enumerate(fwd) if not math.isfinite(v)), None)
        first_bwd = next((k for k, v in enumerate(bwd) if not math.isfinite(v)), None)
        if first_fwd is not None:
            self._nonfinite_forward(rec, rec.fwd_modules[first_fwd], fwd[first_fwd])
        elif first_bwd is not None:  # with a non-finite forward every gradient is garbage: AMP601 explains it
            self._nonfinite_backward(rec, first_bwd, bwd)
        rec.replay = None
        rec.fwd, rec.bwd = [], []  # probes of outputs the user keeps alive still hold `rec`: let the values go
        finite_f, finite_b = [v for v in fwd if math.isfinite(v)], [v for v in bwd if math.isfinite(v)]
        return {
            "step": rec.step, "sampled": True,
            "forward": {"values": len(fwd), "max_abs": max(finite_f, default=None),
                        "nonfinite_module": None if first_fwd is None else self._names[rec.fwd_modules[first_fwd]]},
            "backward": {"values": len(bwd), "max_abs": max(finite_b, default=None),
                         "nonfinite_module": None if first_bwd is None else self._names[rec.bwd_modules[first_bwd][0]]},
            "headroom": worst,
        }

    def _check_headroom(self, step: int, step_max: dict[int, float]) -> dict[str, Any] | None:
        worst: tuple[float, int] | None = None
        for i, value in step_max.items():
            limit = self._limit[i]
            if limit is None:
                continue
            ratio = value / limit
            if worst is None or ratio > worst[0]:
                worst = (ratio, i)
            # a container whose output is a child's output only carries it along: blame the child
            if ratio * self.headroom <= 1 or any(step_max.get(d, 0.0) >= value for d in self._descendants[i]):
                continue
            self._report("AMP606", i, Severity.WARNING, step,
                         f"output abs-max {value:.6g} is {ratio:.1%} of the {_LIMIT_NAMES.get(limit, 'format')} "
                         f"maximum {limit:.6g} (flagged above 1/{self.headroom:g} of it) at step {step}; "
                         f"{limit / value:.1f}x more and it overflows to inf")
        return None if worst is None else {"module": self._names[worst[1]], "ratio": worst[0]}

    def _nonfinite_forward(self, rec: "_StepRecord", i: int, value: float) -> None:
        kind = "NaN" if math.isnan(value) else "inf"
        if self.first_nonfinite_module is None:
            self.first_nonfinite_module = self._names[i]
        if ("AMP601", i) in self._reported:
            return
        first = {"module": self._names[i], "class": self._classes[i], "step": rec.step, "kind": kind.lower(),
                 "frames": None, "op": None, "reproduced": None}
        lines = [f"output {kind} at step {rec.step}: the first module, in call order, whose output is not finite; "
                 "the modules after it only carry it along."]
        where = self._label(i)
        if rec.replay is not None and self._replays < MAX_REPLAYS:
            self._replays += 1
            try:
                frames, op = self._diagnose(rec.replay)
            except Exception as exc:  # a failed re-run costs the frames, not the monitor
                lines.append(f"Re-running the forward to dump frames failed: {type(exc).__name__}: {exc}")
            else:
                where = self._explain(i, frames, op, first, lines) or where
        self._first["forward"] = self._first["forward"] or first
        self._report("AMP601", i, Severity.ERROR, rec.step, "\n".join(lines), where=where)

    def _explain(self, i: int, frames: list["_Frame"], op: NonfiniteOp | str | None, first: dict[str, Any],
                 lines: list[str]) -> str | None:
        """Add what the re-runs showed to ``first`` and ``lines``; return a better ``where`` if the op names one."""
        culprit = frames[-1] if frames and not frames[-1].output_finite else None
        first["reproduced"] = culprit is not None and culprit.name == self._names[i]
        first["frames"] = [f.to_dict() for f in frames]
        where = None
        if isinstance(op, NonfiniteOp):
            first["op"] = op.to_dict()
            lines.append(f"Origin: {op.describe()}")
            if op.module != self._names[i]:  # made non-finite in a parent's own code, before this module ran
                where = f"{op.module} ({op.module_class})" if op.module_class else op.module
                lines.append(f"The first module with a non-finite output was {self._label(i)}; its input was made "
                             f"non-finite earlier, by {op.op} in {where}.")
        elif isinstance(op, str):
            lines.append(f"The op-level re-run failed: {op}")
        elif culprit is not None and culprit.weights_finite is False:
            lines.append("Its weights are already non-finite: an earlier optimizer step wrote inf/NaN into them.")
        elif culprit is not None and culprit.inputs_finite is False:
            lines.append("Its input was already non-finite and no op in the model made it so: the inputs given "
                         "to the model hold inf/NaN.")
        if not first["reproduced"]:
            lines.append("The re-run did not reproduce it (the optimizer stepped since, or the inputs changed); "
                         "the frames below are from the re-run.")
        lines.append(_render_frames(frames))
        return where

    def _nonfinite_backward(self, rec: "_StepRecord", k: int, bwd: list[float]) -> None:
        i, value = rec.bwd_modules[k][0], bwd[k]
        kind = "NaN" if math.isnan(value) else "inf"
        if self.first_nonfinite_module is None:
            self.first_nonfinite_module = self._names[i]
        if k == 0:
            origin = ("It is the first gradient of the backward pass, so it came straight from the loss: the loss "
                      "(times the loss scale) overflows.")
            upstream = None
        else:
            upstream = self._names[rec.bwd_modules[k - 1][0]]
            origin = (f"The gradient was still finite (abs-max {bwd[k - 1]:.3g}) at the output of "
                      f"{self._label(rec.bwd_modules[k - 1][0])}, just before in backward order, so the backward "
                      f"of what consumes this module's output made it {kind}.")
        self._first["backward"] = self._first["backward"] or {
            "module": self._names[i], "class": self._classes[i], "step": rec.step, "kind": kind.lower(),
            "upstream": upstream}
        self._report("AMP602", i, Severity.WARNING, rec.step,
                     f"the gradient w.r.t. its output is {kind} at step {rec.step}: the first non-finite gradient "
                     f"in backward order, with a finite forward pass. {origin}{self._scale_note()}")

    def _diagnose(self, replay: "_Replay") -> tuple[list["_Frame"], NonfiniteOp | str | None]:
        """Re-run the recorded forward with frame hooks; then, unless a weight is non-finite, at the op level.

        Returns the frames and the op found (or the error text of a failed op-level re-run, or None).
        """
        model = self._require_model()
        frames: collections.deque[_Frame] = collections.deque(maxlen=max(self.frames, 1))
        done = []

        def dump(name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not done:
                frames.append(_Frame.measure(name, module, args, kwargs, output))
                if not frames[-1].output_finite:
                    done.append(True)

        handles = [m.register_forward_hook(functools.partial(dump, n or "(root)"), with_kwargs=True)
                   for n, m in model.named_modules()]
        active, self._active, self._replaying = self._active, False, True
        op: NonfiniteOp | str | None = None
        try:
            replay.run(model, model)
            for handle in handles:
                handle.remove()
            culprit = frames[-1] if done else None
            if culprit is not None and culprit.weights_finite is not False:
                # finite inputs: the inf arose inside the culprit, so look there only (an inf that some other
                # module makes and masks away is no origin); non-finite inputs: anywhere before it
                within = culprit.name if culprit.inputs_finite is not False else None

                def trace(*args: Any, **kwargs: Any) -> NonfiniteOp | None:
                    with NonfiniteOpTracer(model, within=within) as tracer:
                        model(*args, **kwargs)
                    return tracer.found

                try:
                    op = replay.run(model, trace)
                except Exception as exc:  # the frames are still worth reporting
                    op = f"{type(exc).__name__}: {exc}"
        finally:
            for handle in handles:
                handle.remove()
            self._active, self._replaying = active and self.enabled, False
        return list(frames), op

    # ---- results --------------------------------------------------------------------------------------------
    def findings(self) -> list[Finding]:
        """Return the findings so far: AMP601, AMP602, AMP606, and AMP001 if the monitor hit an internal error."""
        return list(self._findings)

    def summary(self) -> dict[str, Any]:
        """Return a JSON-ready summary: per-module max abs seen, headroom ratio, first non-finite fwd/bwd."""
        modules = {}
        for i, name in enumerate(self._names):
            seen, limit = self._max_abs[i], self._limit[i]
            if seen is None and not any(self._nonfinite[i]):
                continue
            modules[name] = {"class": self._classes[i], "max_abs": seen, "limit": limit,
                             "headroom_ratio": None if seen is None or limit is None else seen / limit,
                             "nonfinite_forward_steps": self._nonfinite[i][0],
                             "nonfinite_backward_steps": self._nonfinite[i][1]}
        return {"enabled": self.enabled, "every": self.every, "headroom_factor": self.headroom,
                "sampled_steps": self._sampled, "first_nonfinite_module": self.first_nonfinite_module,
                "first_nonfinite_forward": self._first["forward"], "first_nonfinite_backward": self._first["backward"],
                "modules": modules, "error": self._error}

    # ---- internals ------------------------------------------------------------------------------------------
    def _label(self, i: int) -> str:
        return f"{self._names[i]} ({self._classes[i]})"

    def _report(self, code: str, i: int, severity: Severity, step: int, detail: str, where: str | None = None) -> None:
        if (code, i) not in self._reported:
            self._reported.add((code, i))
            self._findings.append(Finding(code, severity, where or self._label(i), detail, step))

    def _scale_note(self) -> str:
        scaler = self._scaler()
        if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
            return " Gradients seen here are multiplied by the loss scale, if a GradScaler is used."
        return f" Gradients seen here are multiplied by the GradScaler's scale ({scaler.get_scale():g} now)."

    def _require_model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model watched by this ActivationMonitor no longer exists")
        return model

    def _remove_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._active = False

    def _fail(self, exc: BaseException) -> None:
        """Report an internal error once as AMP001 and switch off; the user's training goes on."""
        if self._broken:
            return
        self._broken, self._error = True, f"{type(exc).__name__}: {exc}"
        if self._record is not None:  # break rec.last -> tensor -> probe -> rec, and let go of the inputs
            self._record.closed, self._record.last, self._record.replay = True, None, None
        self._record = None
        self._remove_hooks()
        self._findings.append(Finding("AMP001", Severity.INFO, "ActivationMonitor",
                                      f"{self._error}; the activation monitor is off for the rest of the run"))


class _StepRecord:
    """The device-side values of one sampled step; grad probes hold this, never the monitor or the model."""

    __slots__ = ("step", "fwd", "fwd_modules", "fwd_limits", "bwd", "bwd_modules", "last", "replay", "errors",
                 "closed")

    def __init__(self, step: int) -> None:
        self.step = step
        self.fwd: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fwd_modules: list[int] = []
        self.fwd_limits: list[float | None] = []
        self.bwd: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bwd_modules: list[list[int]] = []
        self.last: tuple | None = None
        self.replay: _Replay | None = None
        self.errors: list[BaseException] = []
        self.closed = False


class _GradProbe:
    """A ``Tensor.register_hook`` callback: keep the gradient's min/max on the device, return None."""

    __slots__ = ("record", "modules")

    def __init__(self, record: _StepRecord) -> None:
        self.record = record
        self.modules: list[int] = []  # the modules that returned this tensor, innermost first

    def __call__(self, grad: torch.Tensor) -> None:
        rec = self.record
        if rec.closed:
            return None
        try:
            if grad.is_floating_point() and grad.numel():
                rec.bwd.append(torch.aminmax(grad.detach()))
                rec.bwd_modules.append(self.modules)
        except Exception as exc:  # raising here would break the user's backward()
            rec.errors.append(exc)
        return None


class _Replay:
    """The root's inputs of one call and the autocast and RNG state it ran with."""

    def __init__(self, args: tuple, kwargs: dict, model_device_type: str | None) -> None:
        self.args, self.kwargs = args, kwargs
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        device = next((d for d in devices if d.type != "cpu"), None)
        self.device_type = device.type if device is not None else model_device_type
        types = {"cpu"} | ({self.device_type} if self.device_type else set())
        self.autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in sorted(types)]
        self.cpu_rng = torch.get_rng_state()
        self.device_rng: tuple[int, torch.Tensor] | None = None
        if self.device_type:
            mod = torch.get_device_module(self.device_type)
            index = device.index if device is not None and device.index is not None else mod.current_device()
            self.device_rng = (index, mod.get_rng_state(index))

    def run(self, model: nn.Module, fn: Callable[..., Any]) -> Any:
        """Call ``fn(*args, **kwargs)`` as the step did, leaving RNG, buffers and the autocast cache untouched."""
        saved = [(b, b.detach().clone()) for b in model.buffers()]
        devices = [self.device_rng[0]] if self.device_rng else []
        try:
            with torch.random.fork_rng(devices=devices, device_type=self.device_type), contextlib.ExitStack() as stack:
                torch.set_rng_state(self.cpu_rng)
                if self.device_rng:
                    torch.get_device_module(self.device_type).set_rng_state(self.device_rng[1], self.device_rng[0])
                stack.enter_context(torch.no_grad())
                for device_type, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False))
                return fn(*self.args, **self.kwargs)
        finally:
            with torch.no_grad():
                for buffer, copy in saved:
                    buffer.copy_(copy)


@dataclass(frozen=True)
class _Frame:
    """One module's abs-min (smallest non-zero magnitude) and abs-max of its weights, inputs and outputs."""

    name: str
    cls: str
    rows: tuple[tuple[str, str, float, float], ...]  # (kind, role, abs_min_nonzero, abs_max)

    @classmethod
    def measure(cls, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> "_Frame":
        named: list[tuple[str, str, torch.Tensor]] = [
            ("weight", n, p) for n, p in module.named_parameters(recurse=False)]
        named += [("input", f"input[{i}]", t) for i, t in enumerate(args) if isinstance(t, torch.Tensor)]
        named += [("input", k, t) for k, t in kwargs.items() if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        named += [("output", "output" if len(outs) == 1 else f"output[{i}]", t) for i, t in enumerate(outs)]
        named = [(k, r, t) for k, r, t in named if t.is_floating_point() and t.numel()]
        if not named:
            return cls(name, type(module).__name__, ())
        device = named[0][2].device
        stats = []
        for _, _, t in named:
            a = t.detach().abs().float()
            stats += [torch.where(a > 0, a, math.inf).amin().to(device), a.amax().to(device)]
        values = torch.stack(stats).view(-1, 2).tolist()
        rows = tuple((k, r, 0.0 if hi == 0 else lo, hi) for (k, r, _), (lo, hi) in zip(named, values))
        return cls(name, type(module).__name__, rows)

    def _finite(self, kind: str) -> bool | None:
        values = [hi for k, _, _, hi in self.rows if k == kind]
        return all(math.isfinite(v) for v in values) if values else None

    @property
    def output_finite(self) -> bool:
        return self._finite("output") is not False

    @property
    def inputs_finite(self) -> bool | None:
        return self._finite("input")

    @property
    def weights_finite(self) -> bool | None:
        return self._finite("weight")

    def to_dict(self) -> dict[str, Any]:
        rows = [{"role": r, "abs_min": json_float(lo), "abs_max": json_float(hi)} for _, r, lo, hi in self.rows]
        return {"module": self.name, "class": self.cls, "rows": rows}


def _render_frames(frames: list[_Frame]) -> str:
    """Render frames like transformers' DebugUnderflowOverflow: ``abs min  abs max  role`` under each module."""
    lines = ["Frames from a re-run of the forward (abs min skips zeros):", "abs min  abs max  metadata"]
    for frame in frames:
        lines.append(f"{'':18}{frame.name} {frame.cls}")
        lines += [f"{lo:8.2e} {hi:8.2e} {role}" for _, role, lo, hi in frame.rows]
    return "\n".join(lines)


def _abs_max(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Return max(|min|, |max|) of each (min, max) pair, copying them to the host in one sync."""
    if not pairs:
        return []
    # DTensor results (DTensor modules): this rank's local values, no communication
    flat = [x.to_local() if hasattr(x, "to_local") else x for pair in pairs for x in pair]
    try:
        stacked = torch.stack(flat)
    except RuntimeError:  # values on several devices (pipeline or model parallel): one copy each
        stacked = torch.stack([x.cpu() for x in flat])
    return stacked.float().abs().view(-1, 2).amax(dim=1).tolist()


@functools.lru_cache(maxsize=None)
def _finfo_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def _limit(t: torch.Tensor) -> float | None:
    """Return the largest value ``t`` can hold where it is going: its own dtype's, or autocast's if lower."""
    limit = _finfo_max(t.dtype) if t.itemsize < 4 else None
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):  # an fp32 output is cast to the autocast dtype by the next op
        cast = _finfo_max(torch.get_autocast_dtype(device_type))
        limit = cast if limit is None else min(limit, cast)
    return limit
