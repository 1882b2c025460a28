"""The loss scale, step by step, and the optimizer steps the loss scaler skipped: a GradScaler's, or a library's own.

``ScaleMonitor`` observes ``scaler.update`` with a pass-through wrapper (``ampdoctor.core.patch.observe``). Just
before ``update()`` runs it copies, on the device, the scale used for this step's backward and the sum of the
scaler's own inf checks of every optimizer (``ampdoctor._torch.scaler.found_inf_flags``) into a preallocated
buffer. That works the same for fused, foreach and for-loop optimizers: with a fused optimizer the
scaler still records ``found_inf`` (``_check_inf_per_device``) and the kernel skips the update itself, so patching
``optimizer.step`` would see a call that changed nothing. Nothing is read on the host until the owner gathers
``pending()`` into its one sync of a sampled step and hands the values back to ``consume()``.

A library's own loss scaler (fairseq's, DeepSpeed's, apex's, Megatron-LM's: ``ampdoctor._compat.loss_scalers``) is
observed in the one method where it decides whether the iteration's step is skipped (fairseq's ``check_overflow``,
which raises ``OverflowError`` to skip; DeepSpeed's ``update_scale(overflow)``; ...): the scale read just before
that call is the one the iteration's backward used, and the call says whether it skipped. Those rows are kept on the
host (the scale is a Python number; Megatron-LM's one-element tensor is copied on its device) and go through the
same history and alarms; the findings name the scaler (``DynamicLossScaler (fairseq)``) instead of ``GradScaler``.

Alarms (host side, at each consume):

* AMP604 (warning) when a run of consecutive skipped steps after step 0 reaches ``skip_run`` (3), or every step
  since step 0 was skipped and there are ``warmup_skip_run`` (8) of them, or more than ``skip_fraction`` (5%) of at
  least 100 steps were skipped. A run from step 0 that ended with a step that succeeded is calibration (the scale
  halves from ``init_scale`` until the gradients fit): AMP604 is then info, from ``warmup_skip_run`` skips on (a
  large ``init_scale`` such as 2**40 costs some 24 steps). The detail is written when the findings are read,
  with the counts of the whole run so far.
* AMP603 when the scale is below 1, or when it is still falling and has fallen far: at least ``collapse_factor``
  (2**8) below the reference, the last step was skipped, and it fell at least ``falling_factor`` (2**3) over the
  last ``window`` (32) steps. The reference is the highest scale a step succeeded with; before any did, the first
  scale used but at most 2**16, GradScaler's default ``init_scale`` (halvings from a larger ``init_scale`` are
  calibration). A scale that fell early and then held (calibration skips, then clean steps) is not a collapse,
  and neither is a lone backoff after a growth, however far below the peak the settled scale is. Its detail says
  where the inf/NaN come from only as far as the owner saw it (``note_forward``): the forward (a module's output
  or the model's input) on the skipped steps whose forward was looked at, a finite forward with a non-finite loss,
  or a finite forward and loss (then the backward pass); with no skipped step's forward looked at, nowhere.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace
from typing import Any, Callable

import torch

from ampdoctor._compat.loss_scalers import loss_scaler_shape
from ampdoctor._torch.scaler import found_inf_flags, has_state_machine, is_enabled, live_scale
from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.patch import PatchHandle, observe
from ampdoctor.core.records import ScaleSummary, scale_entry
from ampdoctor.core.words import counted, scale_text
from ampdoctor.explanations.fixes import scale_collapse_fix
from ampdoctor.monitor.activation_records import is_input

__all__ = ["ScaleMonitor"]

_DEFAULT_INIT_SCALE = 2.0**16  # GradScaler's default init_scale: halvings from above it are calibration
# Skips that go on at this scale and below do not come from it: to overflow fp16 there a gradient would have to
# exceed 65504 * 2**24, about 1.1e12
ANY_SCALE = 2.0**-24


class ScaleMonitor:
    """Record the loss scale and skipped steps of a ``torch.amp.GradScaler``, with no host sync per step.

    Args:
        scaler: an enabled GradScaler (or subclass such as ``ShardedGradScaler``), or a library's own loss scaler
            (``ampdoctor._compat.loss_scalers``: fairseq's ``DynamicLossScaler``, DeepSpeed's, ...).
        capacity: steps buffered on the device between two ``consume()`` calls; the buffer doubles if needed.
        skip_run, warmup_skip_run, skip_fraction, collapse_factor, falling_factor, window: alarm thresholds, see
            the module docstring.
        on_error: called with an exception raised inside the observer (the caller's update still runs).

    >>> scaler = torch.amp.GradScaler("cpu")
    >>> with ScaleMonitor(scaler) as monitor:
    ...     pass
    >>> monitor.steps
    0
    """

    def __init__(self, scaler: Any, *, capacity: int = 64, skip_run: int = 3, warmup_skip_run: int = 8,
                 skip_fraction: float = 0.05, collapse_factor: float = 2.0**8, falling_factor: float = 2.0**3,
                 window: int = 32, on_error: Callable[[BaseException], None] | None = None) -> None:
        self._shape = None if has_state_machine(scaler) else loss_scaler_shape(scaler)
        if self._shape is None and (not hasattr(scaler, "update") or not has_state_machine(scaler)):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or a library's loss scaler (fairseq's, "
                            f"DeepSpeed's, apex's, Megatron-LM's), got {type(scaler).__name__}: {scaler!r:.80}")
        self._scaler: Any = scaler
        self.where = "GradScaler" if self._shape is None else self._shape.label(scaler)   # as the findings name it
        self._rows: list[tuple[Any, bool]] = []   # a library's scaler: (scale used, skipped) since the last pending()
        self._used: Any = None                    # ... the scale read just before its decision
        self.skip_run, self.warmup_skip_run = skip_run, warmup_skip_run
        self.skip_fraction, self.collapse_factor = skip_fraction, collapse_factor
        self.falling_factor, self.window = falling_factor, max(int(window), 1)
        self.on_error = on_error
        self._capacity = max(int(capacity), 1)
        self._buffer: torch.Tensor | None = None  # [capacity, 2]: scale used, inf found (sum over optimizers)
        self._pending = 0  # rows filled since the last consume
        self._in_update = False
        self.disabled = False  # set after an internal error: the observer stays (removed in order on detach)
        self._handle: PatchHandle | None = None
        # host-side state, filled by consume()
        self.steps = 0
        self.skipped = 0
        self.history: list[tuple[int, float]] = []  # (step, scale) whenever the scale used changes
        self.skipped_steps: list[int] = []  # kept up to 10_000; counts stay exact beyond that
        self.current_scale: float | None = None  # the scale after the last consumed update
        self.peak: tuple[int, float] | None = None
        self.reference: tuple[int, float] | None = None  # (step, scale) the fall is measured from: see AMP603
        self.lowest: tuple[int, float] | None = None
        self.succeeded: tuple[int, float] | None = None  # the highest scale a step was not skipped with
        self.run = 0  # consecutive skipped steps up to the last consumed one
        self.run_start = 0
        self.longest_run: tuple[int, int] = (0, 0)  # (length, first step)
        self.longest_later: tuple[int, int] = (0, 0)  # the longest run that started after step 0
        self.warmup: tuple[int, bool] = (0, False)  # skips from step 0 on, and whether a step succeeded since
        self.first_scale: float | None = None
        # what the forward of the skipped steps the owner looked at showed (note_forward), by kind, for AMP603
        self.forwards: dict[str, int] = {}
        self._first_module: str | None = None   # the first module seen with a non-finite output on a skipped step
        self._culprit: str | None = None        # its label, as the activation monitor's AMP601 names it
        self._collapse: str | None = None       # AMP603's numbers, the last time the scale was seen collapsing
        self._findings: list[Finding] = []
        self._reported: set[str] = set()

    # ---- attaching ----------------------------------------------------------------------------------------
    def attach(self) -> "ScaleMonitor":
        """Observe ``scaler.update`` (a library's scaler: its decision, ``_compat.loss_scalers``); return ``self``.
        Attaching twice is a no-op."""
        if self._handle is None and self._shape is not None:
            self._handle = observe(self._scaler, self._shape.method, before=self._before_decision,
                                   after=self._after_decision, raised=self._raised_decision, on_error=self._error)
        elif self._handle is None:
            self._handle = observe(self._scaler, "update", before=self._before_update, after=self._after_update,
                                   on_error=self._error)
        return self

    def detach(self) -> None:
        """Remove the observer and drop the reference to the scaler; gathered history stays."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._scaler = None

    def __enter__(self) -> "ScaleMonitor":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ---- the observer: device copies only -----------------------------------------------------------------
    def _before_update(self, new_scale: Any = None) -> None:
        self._in_update = False
        if self.disabled:
            return
        scaler = self._scaler
        scale = live_scale(scaler)
        if scaler is None or scale is None or not is_enabled(scaler):
            return
        found = [f for flags in found_inf_flags(scaler).values() for f in flags]
        buffer = self._row_buffer(scale.device)
        row = buffer[self._pending]
        # one-element tensors of shape () (GradScaler) or (1,) (ShardedGradScaler's flags)
        row[0].copy_(scale.reshape(()))  # before update(): the scale this step's backward used
        if found:
            # copy now: update() adds the other optimizers' flags into the first tensor in place
            row[1].copy_(found[0].reshape(()))
            for f in found[1:]:
                row[1].add_(f.reshape(()).to(scale.device, non_blocking=True))
        else:  # update() will raise "No inf checks were recorded" unless new_scale is given
            row[1].zero_()
        self._in_update = True

    def _after_update(self, result: Any, new_scale: Any = None) -> None:
        if self._in_update:  # update() returned: the step counts
            self._pending += 1
            self._in_update = False

    def _before_decision(self, *args: Any, **kwargs: Any) -> None:
        """A library's scaler is about to decide: the scale now is the one this iteration's backward used."""
        self._used = None
        if not self.disabled and self._scaler is not None:
            scale = self._shape.scale(self._scaler)
            self._used = scale.detach().clone() if isinstance(scale, torch.Tensor) else scale   # on its device

    def _after_decision(self, result: Any, *args: Any, **kwargs: Any) -> None:
        self._decided(args, kwargs, result, None)

    def _raised_decision(self, exc: BaseException, *args: Any, **kwargs: Any) -> None:
        self._decided(args, kwargs, None, exc)   # fairseq's says "skip" (OverflowError) or "stop" by raising

    def _decided(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
                 raised: BaseException | None) -> None:
        used, self._used = self._used, None
        if used is not None and not self.disabled:
            self._rows.append((used, self._shape.skipped(args, kwargs, result, raised)))

    def _row_buffer(self, device: torch.device) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.device != device:
            buffer = self._buffer = torch.zeros((self._capacity, 2), dtype=torch.float32, device=device)
            self._pending = 0
        elif self._pending == buffer.shape[0]:  # more steps than expected between two syncs: grow on the device
            buffer = self._buffer = torch.cat([buffer, torch.zeros_like(buffer)])
        return buffer

    def _error(self, exc: BaseException) -> None:
        self._in_update = False
        self.disabled = True
        if self.on_error is not None:
            self.on_error(exc)

    # ---- the owner's sync -----------------------------------------------------------------------------------
    def pending(self) -> dict[str, torch.Tensor]:
        """Hand over the device tensors to read in the next sync: the per-step rows since the last call and the
        scale after the last update. The rows are handed over here, not at ``consume``: on CUDA the copy is read a
        step later, and the step in between writes its row already (the copy, started first, is stream-ordered
        before it)."""
        out: dict[str, torch.Tensor] = {}
        if self.disabled:
            return out
        if self._shape is not None:
            return self._library_pending()
        if self._buffer is not None and self._pending:
            out["steps"] = self._buffer[: self._pending]
            self._pending = 0
        scale = live_scale(self._scaler) if self._scaler is not None else None
        if scale is not None:
            out["scale"] = scale.detach().reshape(1)
        return out

    def _library_pending(self) -> dict[str, torch.Tensor]:
        """`pending` of a library's scaler: its rows since the last call and its scale now, as tensors (float64 on
        the CPU; Megatron-LM's on its device)."""
        out: dict[str, torch.Tensor] = {}
        rows, self._rows = self._rows, []
        if rows:
            device = next((s.device for s, _ in rows if isinstance(s, torch.Tensor)), torch.device("cpu"))
            used = torch.stack([torch.as_tensor(s, dtype=torch.float64, device=device).reshape(()) for s, _ in rows])
            skipped = torch.tensor([float(k) for _, k in rows], dtype=torch.float64, device=device)
            out["steps"] = torch.stack([used, skipped], dim=1)
        scale = self._shape.scale(self._scaler) if self._scaler is not None else None
        if scale is not None:
            out["scale"] = torch.as_tensor(scale, dtype=torch.float64).detach().reshape(1)
        return out

    def consume(self, values: dict[str, list[float]]) -> dict[str, Any]:
        """Take the host values of ``pending()``; update history and alarms; return this stretch as JSON-ready."""
        rows = values.get("steps", [])
        first = self.steps
        skipped_now: list[int] = []
        changes: list[list[float]] = []
        for k in range(0, len(rows), 2):
            scale, inf = rows[k], rows[k + 1]
            step = self.steps
            if not self.history or self.history[-1][1] != scale:
                self.history.append((step, scale))
                changes.append([step, scale])
            self._track_scale(step, scale, inf)
            if inf > 0:
                self._count_skip(step)
                skipped_now.append(step)
            else:
                self.run = 0
                self.warmup = (self.warmup[0], True)
            self.steps += 1
        if "scale" in values:
            self.current_scale = values["scale"][0]
            if self.lowest is None or self.current_scale < self.lowest[1]:
                self.lowest = (self.steps, self.current_scale)  # the scale the next step starts from
        self._check()
        return scale_entry(first, self.steps, self.current_scale, changes, skipped_now, self.skipped, self.run)

    def _track_scale(self, step: int, scale: float, inf: float) -> None:
        """Update the peak, the reference, the highest scale a step succeeded with and the lowest scale."""
        if self.peak is None or scale > self.peak[1]:
            self.peak = (step, scale)
        if self.reference is None:
            self.reference = (step, min(scale, _DEFAULT_INIT_SCALE))
            self.first_scale = scale
        if inf <= 0 and (self.succeeded is None or scale > self.succeeded[1]):
            self.succeeded = self.reference = (step, scale)
        if self.lowest is None or scale < self.lowest[1]:
            self.lowest = (step, scale)

    def _count_skip(self, step: int) -> None:
        """Count a skipped step: into the current run of skips, the longest runs, and the run from step 0."""
        if self.run == 0:
            self.run_start = step
        self.run += 1
        self.skipped += 1
        if len(self.skipped_steps) < 10_000:
            self.skipped_steps.append(step)
        if self.run > self.longest_run[0]:
            self.longest_run = (self.run, self.run_start)
        if self.run_start == 0:
            self.warmup = (self.run, False)
        elif self.run > self.longest_later[0]:
            self.longest_later = (self.run, self.run_start)

    # ---- alarms -------------------------------------------------------------------------------------------
    def _check(self) -> None:
        if "AMP604" not in self._reported and self._skips() is not None:
            self._report("AMP604", Severity.WARNING, 0, "")  # its place in the order; findings() writes it
        if not self.collapsing():
            return
        self._collapse = self._collapse_numbers()   # findings() says them with what the forward showed
        if "AMP603" not in self._reported:
            self._report("AMP603", Severity.ERROR, self.steps - 1, "")

    def _skips(self) -> Finding | None:
        """Return the AMP604 finding the skips so far call for, with today's counts, or None."""
        (later, start), (warmup, ended) = self.longest_later, self.warmup
        total = f"{self.skipped} of {self.steps} steps skipped in all"
        if later >= self.skip_run:
            return self._finding("AMP604", Severity.WARNING, start, f"{later} consecutive optimizer steps skipped "
                                 f"from step {start} (inf/NaN gradients); {total}")
        if warmup >= self.warmup_skip_run and not ended:
            return self._finding("AMP604", Severity.WARNING, 0, f"every optimizer step skipped since step 0, "
                                 f"{warmup} so far (inf/NaN gradients at every loss scale tried)")
        if self.steps >= 100 and self.skipped > self.skip_fraction * self.steps:
            return self._finding("AMP604", Severity.WARNING, self.steps - 1, f"{self.skipped} of {self.steps} "
                                 f"optimizer steps skipped ({self.skipped / self.steps:.0%}), more than "
                                 f"{self.skip_fraction:.0%}")
        if warmup >= self.warmup_skip_run:
            settled = self.scale_at(warmup)
            return self._finding("AMP604", Severity.INFO, 0, f"the first {warmup} optimizer steps were skipped while "
                                 f"the loss scale calibrated from {scale_text(self.first_scale)} down to "
                                 f"{scale_text(settled)}, where a step succeeded; "
                                 f"GradScaler(init_scale={settled:g}) would have trained them ({total})")
        return None

    def collapsing(self) -> bool:
        """Return whether the scale is below 1, or far below the reference and still falling (module docstring)."""
        low = self.current_scale
        if low is None or self.reference is None:
            return False
        if low < 1:
            return True
        fell = self.reference[1] / max(low, 1e-45) >= self.collapse_factor
        return fell and self.run > 0 and self.scale_at(self.steps - self.window) / low >= self.falling_factor

    def scale_at(self, step: int) -> float:
        """Return the scale used at ``step`` (the first recorded one before the history starts)."""
        if not self.history:
            return math.nan
        at = bisect.bisect_right(self.history, (step, math.inf)) - 1  # history is in step order
        return self.history[max(at, 0)][1]

    def _collapse_numbers(self) -> str:
        ref_step, ref = self.reference or (0, math.nan)
        low = self.current_scale if self.current_scale is not None else math.nan
        since = "the highest a step succeeded with" if self.succeeded is not None else "its start, at most 65536"
        return (f"loss scale fell from {scale_text(ref)} (step {ref_step}, {since}) to {scale_text(low)} after step "
                f"{self.steps - 1}, "
                f"{self.skipped} of {self.steps} steps skipped, the last {self.run} in a row.")

    def note_forward(self, module: str | None, loss: float | None) -> None:
        """Record what the forward of a skipped step showed, for AMP603 to say where the inf/NaN come from.

        Args:
            module: the first module whose output was inf/NaN (``"(input)"``, ``"(input of netG)"``: a model's
                input already was); None when every module output was finite.
            loss: the loss given to backward on that step (unscaled), None when it was not read.
        """
        if is_input(module):
            kind = "input"
        elif module is not None:
            kind, self._first_module = "module", self._first_module or module
        elif loss is None:
            kind = "outputs"   # the model's outputs were finite; the loss was not read
        else:
            kind = "backward" if math.isfinite(loss) else "loss"
        self.forwards[kind] = self.forwards.get(kind, 0) + 1

    def collapse_detail(self) -> str:
        """Describe the fall of the scale (at the last sampled step that showed it falling), then where the inf/NaN
        come from as far as the forwards looked at show it (``note_forward``)."""
        return f"{self._collapse or self._collapse_numbers()} {self._origin()}"

    def origin(self) -> str | None:
        """Return where the forwards of the skipped steps looked at place the inf/NaN: ``"forward"`` (a module's
        output or the model's input), ``"loss"`` (finite outputs, a non-finite loss), ``"backward"`` (finite outputs
        and loss), ``"outputs"`` (finite outputs, the loss not read), or None when none was looked at."""
        seen = self.forwards
        if seen.get("module") or seen.get("input"):
            return "forward"
        return next((kind for kind in ("loss", "backward", "outputs") if seen.get(kind)), None)

    def _origin(self) -> str:
        seen, kind = self.forwards, self.origin()
        looked = sum(seen.values())

        def on(k: int) -> str:
            steps = f"the {counted(looked, 'skipped step')}" if k == looked else \
                f"{k} of the {looked} skipped steps"
            return f"on {steps} whose forward was looked at"

        if kind == "forward":
            bad = seen.get("module", 0) + seen.get("input", 0)
            rest = f"; on the other {looked - bad} every module output was finite" if bad < looked else ""
            if self._first_module is None:   # the model's input, never a module
                return f"The model's input already held inf/NaN {on(bad)}{rest} (AMP609): no loss scale can fix that."
            culprit = self._culprit or ""
            named = culprit if culprit.startswith(f"{self._first_module} (") else self._first_module
            return (f"The forward pass already produced inf/NaN {on(bad)}{rest}: no smaller scale can fix that. "
                    f"First module with a non-finite output: {named}.")
        if kind == "loss":
            return (f"Every module output was finite {on(seen['loss'])}, and the loss given to backward was inf/NaN: "
                    f"the inf/NaN come from computing the loss, after the model, or from another tensor it reads "
                    f"(a target, a frozen teacher's or encoder's half-precision output).")
        if kind == "backward" and self.beyond_overflow():
            return (f"Every module output and the loss were finite {on(seen['backward'])}, so the inf/NaN arise in "
                    f"the backward pass, and they stayed down to a loss scale of {scale_text(self.lowest_tried())}, "
                    f"where a gradient would have to exceed {65504 / self.lowest_tried():.3g} to overflow fp16: the "
                    f"scale is not the cause. An op makes them at any scale: one that is inf/NaN at 0 in any dtype "
                    f"(the gradient of sqrt or log at 0, 0/0), or an fp16 op on values the scale does not carry "
                    f"(x**2 of fp16 activations in a norm). With activations=True, AMP602 names the first module "
                    f"whose output gradient is inf/NaN.")
        if kind == "backward":
            return (f"Every module output and the loss were finite {on(seen['backward'])}, so the inf/NaN arise in "
                    f"the backward pass: gradients that overflow fp16 at every scale tried, or that are inf/NaN at "
                    f"any scale. With activations=True, AMP602 names the first module whose output gradient is "
                    f"inf/NaN.")
        if kind == "outputs":
            return (f"Every module output was finite {on(seen['outputs'])}, so the inf/NaN arise after the model: "
                    f"in the loss or the backward pass.")
        return ("Where the inf/NaN arise (forward or backward) was not seen: no skipped step's forward was looked "
                "at. With activations=True the watch looks at the forward of every sampled step.")

    def lowest_tried(self) -> float:
        """Return the lowest loss scale a step ran its backward with."""
        return min((scale for _, scale in self.history), default=math.nan)

    def beyond_overflow(self) -> bool:
        """Return whether the steps kept failing at a scale so low (``ANY_SCALE``) that no gradient the scale
        multiplies can overflow fp16: their inf/NaN do not come from the scale."""
        return self.lowest_tried() <= ANY_SCALE

    def name_culprit(self, module: str | None) -> None:
        """Name the first non-finite module as the activation monitor's AMP601 does (``"2 (Linear)"``, with its
        class), when it is the one the forward of a skipped step showed first."""
        self._culprit = module or self._culprit

    def _report(self, code: str, severity: Severity, step: int, detail: str) -> None:
        self._reported.add(code)
        self._findings.append(self._finding(code, severity, step, detail))

    def _finding(self, code: str, severity: Severity, step: int, detail: str) -> Finding:
        return get_rule(code).finding(self.where, detail, step, severity=severity)

    def findings(self) -> list[Finding]:
        """Return AMP603 and AMP604 findings so far (each at most once): AMP604 with the counts of today, AMP603
        with what the forwards looked at so far show."""
        return [self._skips() or f if f.code == "AMP604" else self._collapsed(f) if f.code == "AMP603" else f
                for f in self._findings]

    def _collapsed(self, finding: Finding) -> Finding:
        return replace(finding, detail=self.collapse_detail(),
                       fix=scale_collapse_fix(self.origin(), any_scale=self.beyond_overflow()))

    def section(self) -> ScaleSummary:
        """Return the loss scale's section of a watch summary (``core.records.ScaleSummary``)."""
        return ScaleSummary(self.steps, self.skipped, self.skipped / self.steps if self.steps else 0.0,
                            self.longest_run, self.current_scale, self.peak, self.lowest,
                            tuple(self.history[-200:]), tuple(self.skipped_steps[-200:]), self.where)

    def summary(self) -> dict[str, Any]:
        """Return a JSON-ready summary of the scale and the skipped steps (`section`, as data)."""
        return self.section().to_dict()
