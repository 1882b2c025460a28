"""The guard's decisions that need no observer state: why a call raised, whether a run resumed without the scaler's
state, which scheduler steps followed a skipped optimizer step, and the flags read in one host sync.

Each function reads the scaler through `ampdoctor._torch.scaler` and returns findings; recording them (once per
iteration, counted) is the guard's job.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
from torch.optim import lr_scheduler

from ampdoctor._torch.scaler import OptState, init_growth_tracker, init_scale, live_scale, optimizer_found_inf, stage
from ampdoctor.core.catalog import escalated, get_rule
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.host_reads import to_host
from ampdoctor.core.training import TrainingSetup
from ampdoctor.core.words import counted
from ampdoctor.explanations.culprits import fp16_culprits, no_grad_findings
from ampdoctor.guard.history import Call, Iteration, grads_reset

_Pending = tuple[Iteration, int, str, str, list[Any]]  # iteration, id(optimizer), scheduler class, site, lr
_GRAPH_NODES = 20_000   # autograd nodes walked from a scaled loss (AMP412's suspicious path, once per optimizer)

# AMP409 is info for a few calibration skips. Each scheduler step on a skipped optimizer step puts the schedule one
# step ahead of the weights, so the harm is the drift against the schedule's length:
# - length known (CosineAnnealingLR T_max, OneCycleLR total_steps, PolynomialLR / decaying LinearLR total_iters,
#   transformers' and diffusers' LambdaLR schedules num_training_steps): a warning when the skipped steps are at least
#   10% of it (3 calibration skips of a 60-step schedule, 5%, stay info; the warmup inside it only ends 3 steps early);
# - length unknown (a plain LambdaLR, StepLR, ExponentialLR, ...): a warning when the schedule advanced on skipped steps
#   in at least half of the iterations (and at least 2), or, for a multiplicative schedule (StepLR, MultiStepLR,
#   ExponentialLR, MultiplicativeLR), when those steps moved the learning rate by a factor of 2 or more either way:
#   StepLR(gamma=0.5) on one skipped step halves every later LR. Elsewhere the LR moved during the skips (a warmup's
#   x4 between its steps 0 and 3) is transient: the schedule reaches the same values, a few steps early.
SCHEDULE_LENGTH_SHARE = 0.1
SCHEDULE_SKIPPED_SHARE = 0.5
SCHEDULE_LR_DRIFT = 2.0
# the schedulers whose LR is a product of per-step factors: the factors applied on skipped steps stay in every later LR
_MULTIPLICATIVE = ("StepLR", "MultiStepLR", "ExponentialLR", "MultiplicativeLR")


def infer_failure(scaler: Any, setup: TrainingSetup, call: Call, step: int, reset: bool = False) -> list[Finding]:
    """Return the findings of a ``step``/``unscale_`` that raised with none predicted: missing or fp16 gradients.
    ``reset``: a backward of a loss scaled in this iteration reached the optimizer's parameters."""
    opt = call.optimizer
    if opt is None or call.kind not in ("step", "unscale_"):
        return []
    where = stage(scaler, opt)
    if call.kind == "step" and where is OptState.UNSCALED and not optimizer_found_inf(scaler, opt):
        return missing_grads(opt, setup, step, reset)
    if where is OptState.READY:   # raised inside _unscale_grads_
        if any(getattr(p, "grad", None) is not None and p.grad.dtype == torch.float16
               for g in opt.param_groups for p in g["params"]):
            return fp16_culprits(setup.with_scaler(scaler), opt, step=step)
    return []


def missing_grads(optimizer: Any, setup: TrainingSetup, step: int, reset: bool) -> list[Finding]:
    """Say why ``optimizer``'s parameters have no gradient at its ``scaler.step()`` ("No inf checks were recorded
    for this optimizer"). ``reset``: a backward of this iteration's scaled loss reached them, so they were set to
    None after it (AMP612: zero_grad() between backward and step); else what AMP406 knows (frozen, unused, ...)."""
    if not reset:
        return no_grad_findings(optimizer, setup, step)
    label = setup.optimizer_label(optimizer)
    return [get_rule("AMP612").finding(
        label, f"scaler.scale(loss).backward() reached the parameters of {label} in this iteration, yet none had a "
        f"gradient at scaler.step({label}) ('No inf checks were recorded for this optimizer'): they were set to "
        "None in between, by a zero_grad() between backward() and step(); zero the gradients after the step (or "
        "before the forward)", step, severity=Severity.ERROR)]


def no_scale(method: str, label: str, site: str, step: int) -> Finding:
    """Return AMP405 for a scaler method that ran before any ``scale(loss)``."""
    return get_rule("AMP405").finding(
        label, f"scaler.{method}() at {site} ran before any scaler.scale(loss): backward() ran on the unscaled loss "
        "(or the first call after a resume was unscale_)", step)


def unscale_twice(cur: Iteration, optimizer: Any, label: str, site: str) -> list[Finding]:
    """Tell AMP401 (unscale_ per micro-batch) from AMP402 (an iteration that skipped step and update) by history."""
    prev = cur.unscaled.get(id(optimizer))
    if prev is None:
        return [get_rule(code).finding(label, f"scaler.unscale_({label}) at {site} raised; the first unscale_ happened "
                        "before the guard was attached, so its history cannot tell AMP401 from AMP402",
                        cur.index) for code in ("AMP401", "AMP402")]
    backwards = cur.scale_calls - prev.scale_calls
    norm = ""
    if cur.last_clip is not None and cur.last_clip[0] > prev.seq:
        returned = to_host(cur.last_clip[1].reshape(()), "guard")   # the crash path: one read
        norm = f"; clip_grad_norm_ returned {returned:.4g} in between"
    if grads_reset(prev.grad):
        return [get_rule("AMP402").finding(
            label, f"scaler.unscale_({label}) at {prev.site} was followed by neither scaler.step() nor "
            f"scaler.update(); the gradients were then zeroed and recomputed "
            f"({counted(backwards, 'backward pass', 'backward passes')}), and unscale_ at {site} raised{norm}",
            cur.index)]
    if backwards:
        return [get_rule("AMP401").finding(
            label, f"scaler.unscale_({label}) ran at {prev.site} and again at {site} with "
            f"{counted(backwards, 'backward pass', 'backward passes')} accumulating gradients in between and no "
            f"scaler.step(){norm}; unscale and clip once, at the accumulation boundary", cur.index)]
    return [get_rule("AMP401").finding(
        label, f"scaler.unscale_({label}) ran at {prev.site} and again at {site} with no backward in between: an "
        "explicit unscale_ plus a helper that unscales again (e.g. accelerator.clip_grad_norm_)", cur.index)]


def autocast_on(device_type: str) -> bool:
    """Return whether autocast is enabled now for ``device_type`` (False for a type autocast does not know)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError, ValueError):
        return False


def loss_reaches(roots: list[Any], optimizer: Any) -> bool | None:
    """Return whether the autograd graph under one of ``roots`` (the ``grad_fn`` of the losses given to ``scale()``)
    ends in a parameter of ``optimizer``; None when there is no graph, or it is too large to walk.

    The graph's nodes outlive its backward (only their saved tensors are freed), so this works after backward.
    """
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    stack = list(roots)
    if not stack:
        return None
    kept, seen = [], set()   # nodes are kept alive while walking, so their ids stay theirs
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if len(kept) >= _GRAPH_NODES:
            return None
        kept.append(node)
        seen.add(id(node))
        variable = getattr(node, "variable", None)   # an AccumulateGrad node: the leaf it accumulates into
        if variable is not None and id(variable) in params:
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def keep_found_inf(found: dict[int, list[torch.Tensor]], scale: torch.Tensor) -> dict[int, list[torch.Tensor]]:
    """Return each optimizer's found-inf flags, safe to read after ``update()`` (no host sync)."""
    flags = [t for ts in found.values() for t in ts]
    if len(flags) > 1:
        # update() sums the flags into the first one in place; keep that optimizer's own value
        first_key = next(k for k, ts in found.items() if ts)
        if found[first_key][0].device == scale.device:
            found[first_key][0] = found[first_key][0].clone()
    return found


def resume_finding(scaler: Any, optimizers: list[Any], label: Callable[[Any], str], step: int,
                    facts: Any = None) -> Finding | None:
    """Return AMP410 when an optimizer was restored but the GradScaler was not (no ``scaler.load_state_dict``).

    With ``facts`` (the ``load_state_dict`` calls observed in this process) the answer is read from them, whatever
    the optimizer keeps or the ``init_scale`` is. Without, it is inferred from a fresh scaler at its default scale
    next to an optimizer whose state holds a step count.
    """
    if facts is not None:
        if facts.scaler_restored(scaler):
            return None
        restored = [o for o in optimizers if facts.optimizer_restored(o)]
        if not restored:
            return None
        names = ", ".join(label(o) for o in restored)
        current = live_scale(scaler)
        scale = float(init_scale(scaler) or 0.0) if current is None else None
        shown = f"scale={scale:g}" if scale is not None else "its own loss scale"
        return get_rule("AMP410").finding(
            label(restored[0]), f"{names} had its state restored with load_state_dict(), but the GradScaler was never "
            f"restored (scaler.load_state_dict() was not called): it starts from {shown} with growth tracker 0 "
            "instead of the saved scale", step)
    if live_scale(scaler) is not None:
        return None   # the scaler already ran: the state heuristics only hold for a fresh one
    start = init_scale(scaler)
    if init_growth_tracker(scaler) != 0 or start != _default_init_scale(type(scaler)):
        return None   # load_state_dict() sets both
    for opt in optimizers:
        restored = _optimizer_step(opt)
        if restored:
            return get_rule("AMP410").finding(
                label(opt), f"{label(opt)} was restored at step {restored:g}, but the GradScaler starts from "
                f"scale={start:g} with growth tracker 0: scaler.load_state_dict() was not called", step)
    return None


def split_pending(pending: list[_Pending], cur: Iteration, scaler: Any,
                   force: bool) -> tuple[list[_Pending], list[tuple[_Pending, list[torch.Tensor]]]]:
    """Return the AMP409 checks to keep for later and those to decide now, each with its found-inf flags.

    A check on the open iteration waits for its ``update()``, unless ``force`` reads the flags recorded so far.
    """
    keep, batch = [], []
    for entry in pending:
        record, key = entry[0], entry[1]
        flags = record.found_inf.get(key) if record.found_inf is not None else None
        if flags is None and record is cur:
            if not force:
                keep.append(entry)
                continue
            flags = optimizer_found_inf(scaler, key)
        if flags:
            batch.append((entry, flags))
    return keep, batch


def scheduler_finding(cls: str, label: str, site: str, index: int, *, skipped: int = 1,
                       iterations: int | None = None, lr_factor: float = 1.0, length: int | None = None) -> Finding:
    """Return AMP409: a scheduler stepped after iteration ``index``, whose optimizer step was skipped.

    Args:
        skipped: iterations so far in which this scheduler advanced on a skipped optimizer step (this one included).
        iterations: iterations so far (``index + 1`` when not given).
        lr_factor: the product of the learning-rate changes those scheduler steps made (see ``lr_change``), for a
            multiplicative schedule; 1 elsewhere.
        length: the schedule's length in steps (``schedule_length``), None when it does not say.
    """
    f = get_rule("AMP409").finding(f"{cls} on {label}", f"scheduler.step() at {site} advanced the learning rate after "
                f"iteration {index}, whose optimizer step was skipped (inf/NaN gradients)", index)
    return escalated_finding(f, skipped, index + 1 if iterations is None else iterations, lr_factor, length)


def scheduler_severity(skipped: int, iterations: int, lr_factor: float = 1.0, length: int | None = None) -> Severity:
    """Return AMP409's severity: with the schedule's ``length`` known, a warning when the skipped steps are
    ``SCHEDULE_LENGTH_SHARE`` of it or more; without, when most iterations were skipped with the schedule advancing,
    or when those scheduler steps moved the learning rate by ``SCHEDULE_LR_DRIFT`` or more; else info.

    >>> scheduler_severity(2, 60).value, scheduler_severity(6, 6).value, scheduler_severity(1, 60, 0.5).value
    ('info', 'warning', 'warning')
    >>> scheduler_severity(3, 60, 4.0, length=60).value, scheduler_severity(6, 60, length=60).value
    ('info', 'warning')
    """
    if length:
        return Severity.WARNING if skipped >= SCHEDULE_LENGTH_SHARE * length else Severity.INFO
    drift = lr_factor if lr_factor >= 1 else (1 / lr_factor if lr_factor > 0 else float("inf"))
    if (skipped >= 2 and skipped >= SCHEDULE_SKIPPED_SHARE * iterations) or drift >= SCHEDULE_LR_DRIFT:
        return Severity.WARNING
    return Severity.INFO


def escalated_finding(f: Finding, skipped: int, iterations: int, lr_factor: float = 1.0,
                      length: int | None = None) -> Finding:
    """Return the AMP409 finding ``f`` with the severity its counts earn, and the counts in its detail when they
    make it a warning (for the guard to apply to its counted finding when it reports)."""
    severity = scheduler_severity(skipped, iterations, lr_factor, length)
    if severity is f.severity or f.code != "AMP409":
        return f
    if length:
        drift = (f"{counted(skipped, 'skipped optimizer step')}, {skipped / length:.0%} of its {length} steps: it "
                 f"ends {counted(skipped, 'step')} ahead of the weights")
    else:
        drift = f"skipped optimizer steps in {skipped} of {iterations} iterations"
        if lr_factor != 1.0:
            drift += f", changing the learning rate by x{lr_factor:.3g}"
    return escalated(f, severity, f"{f.detail}; the schedule advanced on {drift}")


def schedule_length(scheduler: Any) -> int | None:
    """Return how many steps ``scheduler``'s schedule spans, None when it does not say (or is a warmup that holds).

    >>> model = torch.nn.Linear(2, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> schedule_length(lr_scheduler.CosineAnnealingLR(opt, T_max=60)), schedule_length(lr_scheduler.StepLR(opt, 5))
    (60, None)
    """
    if isinstance(scheduler, lr_scheduler.LinearLR) and scheduler.end_factor >= scheduler.start_factor:
        return None   # a warmup: the LR holds after total_iters, so the run's length is not the schedule's
    if isinstance(scheduler, (lr_scheduler.CosineAnnealingLR, lr_scheduler.OneCycleLR, lr_scheduler.LinearLR,
                              lr_scheduler.PolynomialLR)):
        for attr in ("T_max", "total_steps", "total_iters"):
            n = getattr(scheduler, attr, None)
            if isinstance(n, int) and n > 0:
                return n
    if isinstance(scheduler, lr_scheduler.LambdaLR):
        lengths = [_training_steps(fn) for fn in scheduler.lr_lambdas]
        return max((n for n in lengths if n), default=None)
    return None


def _training_steps(fn: Any) -> int | None:
    """Return the ``num_training_steps`` a schedule function was made with: transformers' ``get_*_schedule*`` bind it
    with ``functools.partial``, diffusers' ``get_scheduler`` in a closure."""
    bound = dict(getattr(fn, "keywords", None) or {})
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    for name, cell in zip(getattr(code, "co_freevars", ()), cells):
        try:
            bound.setdefault(name, cell.cell_contents)
        except ValueError:   # an empty cell
            continue
    n = bound.get("num_training_steps")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def lr_values(optimizer: Any) -> list[float] | None:
    """Return the learning rate of each param group as host floats; None when one is a tensor off the CPU
    (reading it would wait for the device) or the optimizer has no param groups."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    lrs = [g.get("lr") for g in groups]
    if any(isinstance(lr, torch.Tensor) and (lr.device.type != "cpu" or lr.numel() != 1) for lr in lrs):
        return None
    try:
        return [float(lr) for lr in lrs]
    except (TypeError, ValueError):
        return None


def lr_change(before: list[float] | None, after: list[float] | None) -> float:
    """Return ``after / before`` of the param group whose learning rate moved most (as a factor either way); 1 when
    unknown. For multiplicative schedules (StepLR, ExponentialLR, MultiStepLR) the product of these factors over
    the skipped steps is exactly how far the learning rate is from its schedule.

    >>> lr_change([0.1, 0.01], [0.05, 0.01]), lr_change(None, [0.1])
    (0.5, 1.0)
    """
    if not before or not after or len(before) != len(after):
        return 1.0
    ratios = [a / b if b else (1.0 if a == b else float("inf")) for b, a in zip(before, after)]
    return max(ratios, key=lambda r: r if r >= 1 else (1 / r if r > 0 else float("inf")))


def sum_flags(groups: list[list[torch.Tensor]]) -> list[float]:
    """Return the sum of each list of found-inf flags, with one host transfer per device (explanations only)."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, flags in enumerate(groups):
        for t in flags:
            by_device.setdefault(t.device, []).append((i, t))
    sums = [0.0] * len(groups)
    for items in by_device.values():
        values = to_host(torch.stack([t.reshape(()).float() for _, t in items]), "guard")
        for (i, _), v in zip(items, values):
            sums[i] += v
    return sums


class SkipTally:
    """AMP409 checks decided on the device: per (optimizer, scheduler class, call site), the iterations in which the
    schedule advanced over a skipped optimizer step, the first and last of them, and the log of the learning-rate
    factor those scheduler steps made. Nothing is read back until ``read()`` (when findings are asked for), so the
    guard adds no host sync to a training step; each ``add`` costs a few kernel launches per scheduler step.
    """

    def __init__(self) -> None:
        self._rows: dict[tuple[int, str, str], torch.Tensor] = {}  # [count, first, last, log factor], float64

    def add(self, batch: list[tuple[_Pending, list[torch.Tensor]]]) -> None:
        """Count the checks of ``batch`` (each with its found-inf flags) into their rows, on the flags' device."""
        for (record, key, cls, site, lr), flags in batch:
            skipped = (torch.stack([t.reshape(()).double() for t in flags]).sum() > 0).double()
            row = self._rows.get((key, cls, site))
            if row is None:
                row = self._rows[(key, cls, site)] = torch.zeros(4, dtype=torch.float64, device=skipped.device)
                row[1:2].fill_(math.inf)   # fills on the device: a tensor built from a list would copy, and sync
                row[2:3].fill_(-math.inf)
            log_factor = math.log(lr[1]) if lr[1] > 0 and math.isfinite(lr[1]) else 0.0
            index = float(record.index)
            row += torch.stack([skipped, skipped * 0, skipped * 0, skipped * log_factor])
            row[1] = torch.where(skipped > 0, torch.minimum(row[1], torch.full_like(row[1], index)), row[1])
            row[2] = torch.where(skipped > 0, torch.maximum(row[2], torch.full_like(row[2], index)), row[2])

    def read(self) -> list[tuple[tuple[int, str, str], int, int, int, float]]:
        """Return ``((key, class, site), count, first, last, lr factor)`` for each row that counted a skip.

        The host read, at findings() time only: one per device the rows are on.
        """
        by_device: dict[torch.device, list[tuple[int, str, str]]] = {}
        for where, row in self._rows.items():
            by_device.setdefault(row.device, []).append(where)
        values: dict[tuple[int, str, str], list[float]] = {}
        for keys in by_device.values():
            values.update(zip(keys, to_host(torch.stack([self._rows[k] for k in keys]), "guard")))
        out = []
        for where in self._rows:
            count, first, last, log_factor = values[where]
            if count > 0:
                out.append((where, int(count), int(first), int(last), math.exp(log_factor)))
        return out


def scheduler_classes() -> list[type]:
    """Return LRScheduler and the torch schedulers that define their own step(), except ReduceLROnPlateau."""
    classes = [lr_scheduler.LRScheduler]
    for obj in vars(lr_scheduler).values():
        if (isinstance(obj, type) and issubclass(obj, lr_scheduler.LRScheduler) and "step" in vars(obj)
                and obj is not lr_scheduler.LRScheduler and obj is not lr_scheduler.ReduceLROnPlateau):
            classes.append(obj)
    return classes


def _default_init_scale(cls: type) -> float:
    """Return the ``init_scale`` default of a GradScaler class (2**16 when its signature does not say)."""
    try:
        default = inspect.signature(cls.__init__).parameters["init_scale"].default
    except (KeyError, TypeError, ValueError):
        return 2.0 ** 16
    return float(default) if isinstance(default, (int, float)) else 2.0 ** 16


def _optimizer_step(optimizer: Any) -> float:
    """Return the ``step`` count of the optimizer's first parameter state (0 when it has none)."""
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is not None:   # a tensor (on the device for capturable and fused optimizers): one read, once
            return float(to_host(step, "guard") if isinstance(step, torch.Tensor) else step)
    return 0.0


class ScheduleDrift:
    """How far LR schedulers advanced on skipped optimizer steps, per AMP409 place, to set AMP409's severity.

    ``before``/``after`` bracket each ``scheduler.step()`` whose optimizer step may have been skipped and keep the
    factor it moved the learning rate by; ``add`` counts a decided AMP409 with that factor; ``escalate`` applies
    ``escalated_finding`` to the guard's findings.
    """

    def __init__(self) -> None:
        self._open: dict[int, list[Any]] = {}
        self._places: dict[str, tuple[int, float, int | None]] = {}
        self._shapes: dict[tuple[int, str], tuple[int | None, bool]] = {}   # (length, multiplicative)

    def before(self, scheduler: Any) -> list[Any]:
        """Return ``[lr values before, factor]`` for this scheduler step (the factor is set by ``after``)."""
        lr = [lr_values(getattr(scheduler, "optimizer", None)), 1.0]
        self._open[id(scheduler)] = lr
        key = (id(getattr(scheduler, "optimizer", None)), type(scheduler).__name__)
        if key not in self._shapes:   # once per scheduler class and optimizer
            self._shapes[key] = (schedule_length(scheduler), type(scheduler).__name__ in _MULTIPLICATIVE)
        return lr

    def after(self, scheduler: Any) -> None:
        lr = self._open.pop(id(scheduler), None)
        if lr is not None:
            lr[1] = lr_change(lr[0], lr_values(getattr(scheduler, "optimizer", None)))

    def set(self, where: str, count: int, factor: float, key: tuple[int, str] | None = None) -> None:
        """Record that the schedule of ``key`` (id(optimizer), scheduler class) advanced on ``count`` skipped steps
        at ``where``, moving the LR by ``factor``; the factor counts for a multiplicative schedule only."""
        length, multiplicative = self._shapes.get(key, (None, True)) if key is not None else (None, True)
        self._places[where] = (count, factor if multiplicative else 1.0, length)

    def escalate(self, findings: list[Finding], iterations: int) -> list[Finding]:
        """Return ``findings`` with each AMP409 at the severity its counts earn."""
        return [escalated_finding(f, self._places[f.where][0], iterations, *self._places[f.where][1:])
                if f.code == "AMP409" and f.where in self._places else f for f in findings]


def second_step_finding(first: Call | None, label: str, site: str, scale_calls: int, index: int) -> Finding:
    """AMP404: say that no ``update()`` completed between two steps of one optimizer, and which fix applies.

    Args:
        first: the earlier ``step()`` of this optimizer in the iteration, if recorded.
        label: the optimizer's name, ``optimizer[0] (SGD)``.
        site: ``file:line`` of the second step.
        scale_calls: ``scale()`` calls so far in the iteration, to count the backward passes between the steps.
        index: the iteration.
    """
    detail = (f"scaler.step({label}) at {site} is the second step of {label}, and no scaler.update() completed "
              f"since the first, at {first.site if first else '<unknown>'}")
    between = scale_calls - first.scale_calls if first is not None else None
    if between:
        detail += (f"; {counted(between, 'scaler.scale() call')} ran between the two steps (one loss each): call "
                   "scaler.update() after every scaler.step(), or sum the losses and step once")
    elif between == 0:
        detail += ("; no scaler.scale() ran between them, so the second step reuses the same gradients: drop it, "
                   "or call scaler.update() after the first")
    else:
        detail += "; call scaler.update() after every scaler.step()"
    return get_rule("AMP404").finding(label, detail, index)
