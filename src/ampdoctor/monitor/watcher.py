"""Watch the numerics of a training run: gradient statistics, loss scale, lost updates and activations.

Where and when things are read. Gradients, lost updates and activations are looked at on sampled steps (steps 0,
``every``, 2 * ``every``, ...); the loss scale on every step:

* **Gradients**, on a sampled step, just before ``scaler.step(optimizer)`` (observed, pass-through) when an enabled
  GradScaler is given, otherwise in an optimizer step pre-hook. At that point the grads are final (clipped, if the
  loop clips) and not yet consumed. Whether they still carry the loss scale comes from the scaler's stage for this
  optimizer (READY: scaled; UNSCALED after an explicit ``unscale_``), or, in the pre-hook, from the
  ``optimizer.grad_scale`` the scaler sets for fused optimizers. A fused optimizer unscales ``.grad`` in place
  inside its kernel (checked on CPU AdamW, torch 2.13), so reading after the step would see a different scale.
* **Loss scale and skipped steps** on every step, on the device (``ScaleMonitor``, around ``scaler.update``).
* **Lost updates** around the optimizer step of a sampled step (``LostUpdateMonitor``).
* **Activations** (``activations=True``): ``ActivationMonitor`` hooks, switched on for sampled steps.

The end of a step is the return of ``scaler.update()`` (or of ``optimizer.step()`` without a scaler). On a sampled
step all device tensors of the monitors are concatenated and copied to the host with one ``.tolist()``: one host
sync per sampled step (``Watch.host_syncs`` counts them), plus one at ``detach()`` for the loss scales of the steps
after the last sampled one. The activation monitor syncs once more on its own in its ``step_record()``. Steps that
are not sampled cost a few O(1) Python calls and two device copies of 0-dim tensors.

Do no harm: nothing here writes to parameters, gradients, optimizer or scaler state, or the global RNG. Every hook
is removed on ``detach()``, and references to the model, optimizer and scaler are dropped. An exception inside a
part of the watch is reported once as AMP001 and that part stops; training goes on unchanged.
"""

from __future__ import annotations

import math
import time
import types
from typing import Any, Callable

import torch
from torch import nn
from torch.amp.grad_scaler import OptState

from ampdoctor.core.patch import observe
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.monitor.grad_stats import COLUMNS, FORMATS, KINDS, GradStats, rows_to_dicts
from ampdoctor.monitor.lost_updates import LostUpdateMonitor
from ampdoctor.monitor.recorder import FlightRecorder
from ampdoctor.core.report import Report
from ampdoctor.monitor.loss_scale import ScaleMonitor
from ampdoctor.core.training import TrainingSetup

__all__ = ["watch", "Watch", "STATS", "UNDERFLOW_FRACTION", "SUBNORMAL_FRACTION"]

STATS = ("norms", "full", "exact")  # what GradStats computes: see Watch
# AMP605 when >= 1% of a parameter's non-zero gradients would flush to 0 in fp16 at the loss scale, or >= 10% are
# fp16 subnormals (below 2**-14 after scaling). Gradients an fp16 backward computed have already lost the values
# that rounded to 0 (they are zeros now), so for them the subnormal share is the visible edge of the loss.
UNDERFLOW_FRACTION = 0.01
SUBNORMAL_FRACTION = 0.10


def watch(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None, *, every: int = 50,
          log_dir: str | None = None, activations: bool = False, stats: str = "full", sample: int = 4096,
          fsync: bool = False) -> "Watch":
    """Attach a :class:`Watch` to a training loop and return it; use it as a context manager or call ``detach()``.

    >>> model = nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with watch(model, opt, every=1) as w:
    ...     model(torch.ones(3, 4)).sum().backward(); opt.step()
    >>> w.steps, w.host_syncs
    (1, 1)
    """
    return Watch(model, optimizer, scaler, every=every, log_dir=log_dir, activations=activations, stats=stats,
                 sample=sample, fsync=fsync).attach()


class Watch:
    """The numerics watch of one model, its optimizer and (optionally) its GradScaler.

    Args:
        model: the module being trained (used for parameter and module names, and activation hooks).
        optimizer: the optimizer stepping it; the statistics cover its parameters.
        scaler: the ``torch.amp.GradScaler``, if any. A disabled scaler counts as none.
        every: look closely at every ``every``-th optimizer step (step 0 first); 1 = every step.
        log_dir: write the JSON-lines flight recorder ``ampdoctor.jsonl`` there (or to this ``.jsonl`` file).
        activations: also run ``ActivationMonitor`` (first non-finite module, fp16 headroom) on sampled steps.
        stats: ``"norms"`` (L2 and abs-max), ``"full"`` (everything; counts from ``sample`` entries per
            parameter, exact for smaller ones) or ``"exact"`` (every count over every entry; slow).
        sample: entries per parameter for the counts and the lost-update snapshots.
        fsync: fsync the log after every line (see ``ampdoctor.monitor.recorder``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None, *, every: int = 50,
                 log_dir: str | None = None, activations: bool = False, stats: str = "full", sample: int = 4096,
                 fsync: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}: {model!r:.80}")
        optimizer = _unwrap(optimizer)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}: "
                            f"{optimizer!r:.80}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}; every=1 looks at every step")
        if stats not in STATS:
            raise ValueError(f"stats must be one of {STATS}, got {stats!r}")
        _refuse_meta(model, optimizer)
        self.every, self.stats, self.sample, self.log_dir, self.fsync = every, stats, sample, log_dir, fsync
        self._model: nn.Module | None = model
        self._optimizer: torch.optim.Optimizer | None = optimizer
        self._scaler = scaler if scaler is not None and getattr(scaler, "_enabled", False) else None
        self._want_activations = activations
        setup = TrainingSetup(model)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        infos = [setup.info(p) for p in params]
        self.param_names = [i.name if i else f"optimizer.param{k}" for k, i in enumerate(infos)]
        self.param_modules = [i.module if i else "(not in model)" for i in infos]
        self.param_dtypes = [str(p.dtype).removeprefix("torch.") for p in params]
        self._params: list[torch.Tensor] = params
        self._grad_stats = GradStats([p.numel() for p in params], sample=None if stats == "exact" else sample,
                                     counts=stats != "norms")
        self.steps = 0  # completed optimizer steps (scaler.update() calls with a scaler)
        self.sampled_steps = 0
        self.host_syncs = 0
        # seconds spent computing statistics and closing steps (sync, record, log line); the O(1) per-step
        # observers and the activation monitor's module hooks are not in it
        self.seconds_inside = 0.0
        self.last_record: dict[str, Any] | None = None
        self.norm_history: list[tuple[int, float]] = []  # (step, global grad norm) of sampled steps, up to 10_000
        self.last_grads: dict[str, dict[str, float]] = {}
        self._sampled_now = True
        self._grad_pending: torch.Tensor | None = None
        self._grad_scale: torch.Tensor | None = None  # the loss scale the pending statistics assumed
        self._grad_read = "none"
        self._handles: list[Any] = []
        self._scale: ScaleMonitor | None = None
        self._lost: LostUpdateMonitor | None = None
        self._activations: Any = None
        self._activation_result: tuple[dict[str, Any], list[Finding]] | None = None
        self._recorder: FlightRecorder | None = None
        self._findings: list[Finding] = []
        self._reported: set[tuple[str, str]] = set()
        self._off: set[str] = set()
        self._started = time.perf_counter()
        self.attached = False

    # ---- attaching ------------------------------------------------------------------------------------------
    def attach(self) -> "Watch":
        """Register every hook and observer; return ``self``. Attaching twice is a no-op."""
        if self.attached or self._optimizer is None:
            return self
        opt, scaler = self._optimizer, self._scaler
        self.attached = True
        try:
            if scaler is not None:
                self._scale = ScaleMonitor(scaler, capacity=min(self.every, 1024),
                                           on_error=lambda e: self._fail("scale", e)).attach()
                # installed after ScaleMonitor's: ours wraps it, so the step ends after its observer ran
                self._handles.append(observe(scaler, "step", before=self._before_scaler_step,
                                             on_error=lambda e: self._fail("gradients", e)))
                self._handles.append(observe(scaler, "update", after=self._after_update,
                                             on_error=lambda e: self._fail("watch", e)))
            else:
                self._handles.append(opt.register_step_pre_hook(self._optimizer_pre_hook))
                self._handles.append(opt.register_step_post_hook(self._optimizer_post_hook))
            named = list(zip(self.param_names, self._params))
            self._lost = LostUpdateMonitor(named, sample=self.sample, on_error=lambda e: self._fail("lost_updates", e))
            self._lost.attach(opt)
            if self._want_activations:
                self._guard("activations", self._attach_activations)
            if self.log_dir is not None:  # an unwritable log_dir must not stop the training: AMP001 says so
                self._guard("recorder", self._open_recorder)
            self._set_sampling(self.steps % self.every == 0)
        except Exception:
            self.detach()
            raise
        return self

    def _attach_activations(self) -> None:
        from ampdoctor.monitor.activations import ActivationMonitor

        self._activations = ActivationMonitor(self._model, setup=types.SimpleNamespace(scaler=self._scaler))
        self._activations.attach()

    def _open_recorder(self) -> None:
        self._recorder = FlightRecorder(self.log_dir, self._header(), fsync=self.fsync)

    def detach(self) -> None:
        """Flush what is pending, remove every hook, close the log and drop references to the training objects."""
        if self._optimizer is None:
            return
        if self.attached and "watch" not in self._off:
            self._guard("watch", self._flush, partial=True)
        # Every handle of every part goes, failed parts included; detach() itself never raises.
        handles, self._handles = self._handles, []
        for handle in reversed(handles):  # last installed first: restores the scaler exactly
            _quietly(handle.remove)
        if self._scale is not None:
            _quietly(self._scale.detach)
        if self._lost is not None:
            _quietly(self._lost.detach)
        if self._activations is not None:
            activations = self._activations
            if "activations" not in self._off:
                self._guard("activations", activations.detach)  # records the pending step, removes the hooks
            _quietly(activations._remove_hooks)  # a part that is off keeps no hook either
            self._activation_result = _quietly(lambda: (activations.summary(), activations.findings()))
            self._activations = None
        if self._recorder is not None:
            self._guard("recorder", lambda: self._recorder.close({"steps": self.steps, "summary": self.summary_data()}))
        self._model = self._optimizer = self._scaler = None
        self._params, self._grad_pending = [], None
        self.attached = False

    def __enter__(self) -> "Watch":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    @property
    def log_path(self) -> str | None:
        """The flight recorder's file, if any."""
        return None if self._recorder is None else str(self._recorder.path)

    # ---- hooks ----------------------------------------------------------------------------------------------
    def _before_scaler_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if optimizer is not self._optimizer or not self._sampled_now or "gradients" in self._off:
            return
        scaler = self._scaler
        state = scaler._per_optimizer_states.get(id(optimizer))  # .get: never create the scaler's entry
        stage = OptState.READY if state is None else state["stage"]
        self._read_grads(scaler._scale, scaled=stage is OptState.READY)

    def _optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._sampled_now and "gradients" not in self._off:
            # A GradScaler we were not given sets grad_scale on a fused optimizer: its grads are still scaled.
            grad_scale = getattr(optimizer, "grad_scale", None)
            scaled = isinstance(grad_scale, torch.Tensor)
            self._guard("gradients", lambda: self._read_grads(grad_scale if scaled else None, scaled=scaled))
        return None

    def _optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if "watch" in self._off:
            self.steps += 1  # the watch is off, but the steps still count (O(1), nothing else)
            return
        self._guard("watch", self._end_step)

    def _after_update(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if "watch" in self._off:
            self.steps += 1
            return
        self._end_step()

    def _read_grads(self, scale: torch.Tensor | None, scaled: bool) -> None:
        if self._grad_pending is not None:  # already read this step (two scaler.step calls would raise anyway)
            return
        start = time.perf_counter()
        self._grad_pending = self._grad_stats.compute([p.grad for p in self._params], scale, scaled)
        self._grad_scale = None if scale is None else scale.detach().reshape(1).clone()
        self._grad_read = "scaled" if scaled else "unscaled"
        self.seconds_inside += time.perf_counter() - start

    # ---- the end of a step ----------------------------------------------------------------------------------
    def _end_step(self) -> None:
        start = time.perf_counter()
        try:
            if self._sampled_now:
                self._flush()
        finally:  # a failing flush (reported by the caller) still ends the step
            self.steps += 1
            self.seconds_inside += time.perf_counter() - start
        self._set_sampling(self.steps % self.every == 0)

    def _set_sampling(self, active: bool) -> None:
        self._sampled_now = active
        if self._lost is not None and "lost_updates" not in self._off:
            self._lost.set_sampling(active)
        if self._activations is not None and "activations" not in self._off:
            self._guard("activations", lambda: self._activations.set_sampling(active))

    def _flush(self, partial: bool = False) -> None:
        """The one host sync of a sampled step: read every monitor's device tensors, record, raise alarms."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        if self._grad_pending is not None:
            parts["gradients"] = {"rows": self._grad_pending}
            if self._grad_scale is not None:
                parts["gradients"]["scale"] = self._grad_scale
        if self._scale is not None and "scale" not in self._off:
            parts["scale"] = self._scale.pending()
        if self._lost is not None and "lost_updates" not in self._off:
            parts["lost_updates"] = self._lost.pending()
        if partial and not parts.get("gradients") and not parts.get("lost_updates") \
                and "steps" not in parts.get("scale", {}):
            return  # detached right after a sampled step: nothing new
        host = self._sync(parts)
        self._grad_pending = self._grad_scale = None
        step = self.steps - 1 if partial else self.steps  # partial: written at detach, after the last step
        record: dict[str, Any] = {"type": "step", "step": step, "t": round(time.perf_counter() - self._started, 4)}
        if "gradients" in host:
            self._guard("gradients", lambda: record.update(gradients=self._gradient_record(host["gradients"], step)))
        if "scale" in host:
            self._guard("scale", lambda: record.update(scale=self._scale.consume(host["scale"])))
        if "lost_updates" in host:
            self._guard("lost_updates",
                        lambda: record.update(lost_updates=self._lost.consume(host["lost_updates"], step)))
        if self._activations is not None and "activations" not in self._off and not partial:
            self._guard("activations", lambda: record.update(activations=self._activations.step_record(step)))
        self._guard("gradients", lambda: self._check_gradients(record, step))
        if partial:
            record["partial"] = True  # written at detach: the steps since the last sampled one
        else:
            self.sampled_steps += 1
        self.last_record = record
        if self._recorder is not None and "recorder" not in self._off:
            self._guard("recorder", lambda: self._recorder.write(record))

    def _sync(self, parts: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, list[float]]]:
        flat = [(m, k, t) for m, d in parts.items() for k, t in d.items()]
        if not flat:
            return {m: {} for m in parts}
        device = flat[0][2].device
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        joined = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for _, _, t in flat])
        values = joined.tolist()  # the one host sync
        self.host_syncs += 1
        out: dict[str, dict[str, list[float]]] = {m: {} for m in parts}
        offset = 0
        for m, k, t in flat:
            out[m][k] = values[offset:offset + t.numel()]
            offset += t.numel()
        return out

    def _gradient_record(self, values: dict[str, list[float]], step: int) -> dict[str, Any]:
        width = len(COLUMNS)
        flat = values["rows"]
        rows = [flat[i:i + width] for i in range(0, len(flat), width)]
        self.last_grads = rows_to_dicts(rows, self.param_names)
        norms = [s["l2"] for s in self.last_grads.values()]
        total = math.sqrt(sum(n * n for n in norms)) if norms else None
        if total is not None and len(self.norm_history) < 10_000:
            self.norm_history.append((step, total))
        scale = values.get("scale")
        return {"read": self._grad_read, "loss_scale": scale[0] if scale else None, "global_norm": total,
                "rows": rows}

    # ---- alarms ---------------------------------------------------------------------------------------------
    def _check_gradients(self, record: dict[str, Any], step: int) -> None:
        grads = record.get("gradients")
        if not grads or grads["global_norm"] is None:
            return
        skipped = step in (record.get("scale") or {}).get("skipped", [])
        if not math.isfinite(grads["global_norm"]) and not skipped:
            bad = [n for n, s in self.last_grads.items() if not math.isfinite(s["l2"])]
            self._report("AMP608", Severity.WARNING, ", ".join(bad[:3]) + (" …" if len(bad) > 3 else ""), step,
                         f"global gradient norm {grads['global_norm']} at step {step} and the step was not skipped "
                         f"(no GradScaler skipped it); {len(bad)} parameter(s) with non-finite gradients")
        if self._scaler is None or self.stats == "norms":
            return
        scale = grads.get("loss_scale")
        flagged = [(s["fp16_underflow"], s["fp16_subnormal"], n) for n, s in self.last_grads.items()
                   if s.get("fp16_underflow", 0.0) >= UNDERFLOW_FRACTION
                   or s.get("fp16_subnormal", 0.0) >= SUBNORMAL_FRACTION]
        for under, subnormal, name in sorted(flagged, reverse=True)[:5]:
            self._report("AMP605", Severity.WARNING, name, step,
                         f"{under:.1%} of the non-zero gradient entries would round to 0 in fp16 and {subnormal:.1%} "
                         f"are fp16 subnormals at loss scale {'?' if scale is None else f'{scale:g}'}; smallest "
                         f"non-zero |grad| {self.last_grads[name]['min_nonzero']:.3g}. fp16's smallest subnormal is "
                         f"2**-24 ≈ 6e-8 and its smallest normal 2**-14 ≈ 6.1e-5, after scaling")

    def _report(self, code: str, severity: Severity, where: str, step: int, detail: str) -> None:
        if (code, where) not in self._reported:
            self._reported.add((code, where))
            self._findings.append(Finding(code, severity, where, detail, step))

    def _guard(self, part: str, fn: Callable[[], Any], **kwargs: Any) -> Any:
        if part in self._off:
            return None
        try:
            return fn(**kwargs)
        except Exception as exc:
            self._fail(part, exc)
            return None

    def _fail(self, part: str, exc: BaseException) -> None:
        """Report an internal error of ``part`` once (AMP001) and switch that part off; training is untouched."""
        if part in self._off:
            return
        self._off.add(part)
        self._findings.append(Finding("AMP001", Severity.INFO, f"ampdoctor.watch ({part})",
                                      f"{type(exc).__name__}: {exc}; this part of the watch is off for the rest of "
                                      f"the run", self.steps))
        # Switch the part off without removing observers: removing a patch that another one wraps would leave it
        # behind; detach() removes everything in reverse order.
        if part in ("gradients", "watch"):
            self._grad_pending = None
        if part in ("scale", "watch") and self._scale is not None:
            self._scale.disabled = True
        if part in ("lost_updates", "watch") and self._lost is not None:
            # A flag, not detach(): _fail runs inside optimizer step hooks, and torch iterates over the hook
            # dicts live during step(), so removing a hook here would raise in the user's step(). detach()
            # removes the hooks.
            try:
                self._lost.disable()
            except Exception:
                pass
        if part in ("activations", "watch") and self._activations is not None:
            try:
                self._activations.set_sampling(False)
            except Exception:
                pass
        if part == "recorder" and self._recorder is not None:
            try:
                self._recorder.close()
            except Exception:
                pass
        if part == "watch":
            self._off.update({"gradients", "scale", "lost_updates", "activations"})

    # ---- results --------------------------------------------------------------------------------------------
    def findings(self) -> list[Finding]:
        """Return the findings so far: AMP603/604/605/607/608 (and AMP601/602/606 with ``activations=True``)."""
        activation = self._activation_findings()
        culprit = next((f.where for f in activation if f.code == "AMP601"), None)
        out = list(self._findings)
        if self._scale is not None:
            self._scale.name_culprit(culprit)
            out += self._scale.findings()
        if self._lost is not None:
            out += self._lost.findings()
        return out + activation

    def _activation_findings(self) -> list[Finding]:
        if self._activations is not None:
            return self._activations.findings()
        return self._activation_result[1] if self._activation_result else []

    def summary_data(self) -> dict[str, Any]:
        """Return the JSON-ready summary (``Report.extra["watch"]``)."""
        grads: dict[str, Any] = {"params": self.last_grads, "modules": module_rollup(self.last_grads,
                                                                                     self._module_of())}
        if self.norm_history:
            step, norm = self.norm_history[-1]
            peak = max(self.norm_history, key=lambda sn: sn[1] if math.isfinite(sn[1]) else -1.0)
            grads.update(step=step, global_norm=norm, max_global_norm={"step": peak[0], "value": peak[1]})
        activations = self._activations.summary() if self._activations is not None else (
            self._activation_result[0] if self._activation_result else None)
        return {
            "steps": self.steps, "sampled_steps": self.sampled_steps, "every": self.every, "stats": self.stats,
            "sample": self.sample, "host_syncs": self.host_syncs, "log_path": self.log_path,
            "seconds_inside": round(self.seconds_inside, 6),
            "scale": None if self._scale is None else self._scale.summary(),
            "gradients": grads,
            "lost_updates": None if self._lost is None or not self._lost.names else self._lost.summary(),
            "activations": activations,
            "off": sorted(self._off),
        }

    def _module_of(self) -> dict[str, str]:
        return dict(zip(self.param_names, self.param_modules))

    def summary(self) -> Any:
        """Return a rich renderable of the summary and the findings."""
        return _render_watch(self.summary_data(), self.findings())

    def report(self) -> Report:
        """Return an ``ampdoctor.core.report.Report`` with the findings and ``extra={"watch": summary_data()}``."""
        from ampdoctor.core.environment import environment

        report = Report(environment=environment(), extra={"watch": self.summary_data()})
        for f in self.findings():
            report.add(f)
        return report

    def _header(self) -> dict[str, Any]:
        from ampdoctor import __version__
        from ampdoctor.core.environment import environment

        opt, scaler = self._optimizer, self._scaler
        defaults = getattr(opt, "defaults", {})
        return {
            "ampdoctor": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": environment(),
            "every": self.every, "stats": self.stats, "sample": self.sample,
            "optimizer": {"class": type(opt).__name__, "fused": defaults.get("fused"),
                          "foreach": defaults.get("foreach")},
            "scaler": None if scaler is None else {"class": type(scaler).__name__,
                                                   "growth_interval": getattr(scaler, "_growth_interval", None),
                                                   "backoff_factor": getattr(scaler, "_backoff_factor", None)},
            "formats": {f.name: {"max": f.max, "min_subnormal": f.min_subnormal, "underflow_at_most":
                                 f.underflow_at_most, "overflow_above": f.overflow_above} for f in FORMATS},
            "grad_columns": list(COLUMNS),
            "params": [{"name": n, "module": m, "dtype": d, "shape": list(p.shape)}
                       for n, m, d, p in zip(self.param_names, self.param_modules, self.param_dtypes, self._params)],
        }


def _refuse_meta(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise a ValueError up front when the model or the optimizer holds parameters on the meta device."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    in_opt = sum(1 for g in optimizer.param_groups for p in g["params"] if isinstance(p, torch.Tensor) and p.is_meta)
    if meta or in_opt:
        where = f"{len(meta)} parameter(s) of the model (first: {meta[0]!r})" if meta else \
            f"{in_opt} parameter(s) of the optimizer"
        raise ValueError(f"watch() got {where} on the meta device: meta tensors hold no values, so there are no "
                         f"gradients, loss scales or activations to watch. Materialise the model first "
                         f"(model.to_empty(device=...) and load its weights, or build it on a real device), "
                         f"create the optimizer for those parameters, then call watch()")


def _quietly(fn: Callable[[], Any]) -> Any:
    """Call ``fn``; return its result, or ``None`` if it raised (clean-up that must not stop detach())."""
    try:
        return fn()
    except Exception:
        return None


def _unwrap(optimizer: Any) -> Any:
    """Return the torch optimizer inside a wrapper that only delegates to it (accelerate's AcceleratedOptimizer):
    the wrapper has no hook tables of its own, and the GradScaler steps the inner optimizer."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and not hasattr(optimizer, "_optimizer_step_pre_hooks"):
        return inner
    return optimizer


def module_rollup(params: dict[str, dict[str, float]], module_of: dict[str, str]) -> dict[str, dict[str, float]]:
    """Combine per-parameter statistics into per-module ones: L2 of L2s, max of maxes, min of mins, summed counts,
    and fractions weighted by the entries they were measured on.

    >>> module_rollup({"fc.w": {"l2": 3.0, "absmax": 2.0}, "fc.b": {"l2": 4.0, "absmax": 1.0}}, {"fc.w": "fc",
    ...                "fc.b": "fc"})
    {'fc': {'params': 2, 'l2': 5.0, 'absmax': 2.0}}
    """
    out: dict[str, dict[str, float]] = {}
    for module, names in _group(params, module_of).items():
        stats = [params[n] for n in names]
        rolled: dict[str, float] = {"params": len(stats), "l2": math.sqrt(sum(s["l2"] ** 2 for s in stats)),
                                    "absmax": max(s["absmax"] for s in stats)}
        if all("sampled" in s for s in stats):  # counts were computed (stats != "norms")
            weights = [s["sampled"] for s in stats]
            total = sum(weights) or 1
            rolled.update(min_nonzero=min(s["min_nonzero"] for s in stats),
                          nonfinite=sum(s["nonfinite"] for s in stats),
                          zero_frac=sum(s["zero_frac"] * w for s, w in zip(stats, weights)) / total)
            for f in FORMATS:
                for kind in KINDS:
                    key = f"{f.name}_{kind}"
                    rolled[key] = sum(s[key] * w for s, w in zip(stats, weights)) / total
        out[module] = rolled
    return out


def _group(params: dict[str, Any], module_of: dict[str, str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in params:
        groups.setdefault(module_of.get(name, "(not in model)"), []).append(name)
    return groups


def _render_watch(data: dict[str, Any], findings: list[Finding]) -> Any:
    """Return a rich renderable of ``Watch.summary_data()`` and the findings."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(
        f"ampdoctor watch: {data['steps']} steps, {data['sampled_steps']} sampled (every {data['every']}), "
        f"stats={data['stats']}, {data['host_syncs']} host syncs", style="bold")]
    scale = data.get("scale")
    if scale:
        peak, lowest = scale.get("peak") or {}, scale.get("lowest") or {}
        run = scale["longest_skip_run"]
        parts.append(Text(
            f"loss scale {_num(scale.get('current'))} (peak {_num(peak.get('scale'))} at step {peak.get('step')}, "
            f"lowest {_num(lowest.get('scale'))}); skipped {scale['skipped']} of {scale['steps']} steps "
            f"({scale['skipped_fraction']:.1%}), longest run {run['length']}"))
    grads = data.get("gradients") or {}
    if grads.get("modules"):
        table = Table(title=f"gradients at step {grads.get('step')} (unscaled; global norm "
                            f"{_num(grads.get('global_norm'))})", expand=False)
        table.add_column("module", overflow="fold", min_width=6)
        for col in ("L2", "max|g|", "min|g|>0", "zeros", "inf/nan", "fp16 u/o", "bf16 u/o", "e4m3 u/o",
                    "e5m2 u/o"):  # u/o: share of non-zero gradients that would underflow / overflow
            table.add_column(col, justify="right", no_wrap=True)
        for module, s in sorted(grads["modules"].items(), key=lambda kv: -_sortable(kv[1]["l2"]))[:20]:
            if "zero_frac" not in s:  # stats="norms"
                table.add_row(module, _num(s["l2"]), _num(s["absmax"]), *["-"] * 7)
                continue
            table.add_row(module, _num(s["l2"]), _num(s["absmax"]), _num(s["min_nonzero"]), f"{s['zero_frac']:.0%}",
                          str(s["nonfinite"]), *(f"{_pct(s[f.name + '_underflow'])}/{_pct(s[f.name + '_overflow'])}"
                                                 for f in FORMATS))
        parts.append(table)
    lost = data.get("lost_updates")
    if lost and lost.get("params"):
        table = Table(title="updates lost to rounding (sampled entries with a non-zero gradient left unchanged)")
        table.add_column("parameter")
        table.add_column("dtype")
        table.add_column("lost", justify="right")
        for name, s in sorted(lost["params"].items(), key=lambda kv: -kv[1]["lost_fraction"])[:20]:
            table.add_row(name, s["dtype"], f"{s['lost_fraction']:.0%}")
        parts.append(table)
    if data.get("log_path"):
        parts.append(Text(f"flight recorder: {data['log_path']}", style="dim"))
    if findings:
        from ampdoctor.ui.console import findings_table

        parts.append(findings_table(sorted(findings, key=lambda f: f.severity.rank), title="watch findings"))
    else:
        parts.append(Text("no numerical problems seen", style="green"))
    return Group(*parts)


def _sortable(value: float) -> float:
    return math.inf if not math.isfinite(value) else value


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def _pct(value: float) -> str:
    return "0" if not value else f"{value:.1%}" if value >= 0.001 else "<0.1%"
