"""The numerics audit, as a part of a watch: audited steps re-run their low-precision ops in fp32 (AMP701 to AMP706,
AMP708).

``monitor.numerics.NumericsAudit`` does the work; this part says which steps it audits and turns what it saw into
findings. By default (``audit="auto"``) it audits the first step the watch samples and, once, the step after the
first anomaly (a skipped step, a non-finite gradient norm or loss), and the first step it sees whole; ``"all"``
audits every sampled step, a tuple of step numbers those steps, ``"off"`` none. An audited step starts where the step
before it ended, so that what the loop does before the forward (casting timesteps, building a schedule) is audited
too; the first step of a watch attached before the loop starts at the first forward of one of the run's models or
their children (a forward pre-hook on each, which on other steps returns at once). It ends when its optimizer step
starts. Its device values travel in the sampled step's one host copy. A compiled model (``torch.compile``) is not
audited.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from ampdoctor._torch.dispatch import tree_leaves
from ampdoctor._torch.modules import is_compiled
from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.host_reads import HostReads, to_host
from ampdoctor.core.names import module_label
from ampdoctor.core.options import AUDIT_AUTO, AUDIT_OFF, check_every
from ampdoctor.core.records import AuditedOp, AuditSection, Extras, Step, WatchSummary
from ampdoctor.core.report import Report
from ampdoctor.core.usage import UsageError
from ampdoctor.monitor.numerics import Event, NumericsAudit, Site
from ampdoctor.monitor.part import Reading, WatchContext, WatchPart, register_part
from ampdoctor.monitor.watched import other_models

__all__ = ["AuditPart", "audit", "audit_findings"]

_CODES = {"constant": "AMP701", "nonfinite": "AMP702", "zeros": "AMP703", "integer": "AMP704", "graded": "AMP705",
          "fp32-gemm": "AMP706", "recompute": "AMP708"}
_WORST = 10      # the worst ops the summary keeps
_MODULES = 40    # the modules whose worst error it keeps


@register_part
class AuditPart(WatchPart, name="audit", codes=tuple(_CODES.values()), order=70):
    """The numerics audit of a watch, on the steps its policy names."""

    def __init__(self, ctx: WatchContext, policy: Any) -> None:
        self._ctx: WatchContext | None = ctx
        self.policy = policy
        frozen = list(ctx.frozen()) if ctx.frozen is not None else []
        self._models = [(ctx.model, ctx.prefix), *other_models(ctx.model, ctx.others, frozen, ctx.run_names)]
        labels = {module: module_label(name, prefix) for model, prefix in self._models
                  for name, module in model.named_modules()}
        self.audit = NumericsAudit(labels, on_error=functools.partial(ctx.fail, "audit"))
        self._scaled = ctx.scaler is not None or ctx.loss_scaler is not None
        self._handles: list[Any] = []
        self._sampled = True
        self._boundary = False   # a step boundary was seen since the attach
        self._whole = False      # a step was audited from its start
        self._armed: set[int] = set()     # auto: steps audited after an anomaly
        self._anomaly_seen = False
        self._audited: list[int] = []
        self._step: int | None = None     # the step being audited, until its values are read
        self._events: list[tuple[int, Event]] = []
        self._worst: list[AuditedOp] = []
        self._modules: dict[str, float] = {}
        self._step_flops: dict[int, int] = {}
        self._flops_seen = 0

    @classmethod
    def create(cls, ctx: WatchContext) -> "AuditPart | None":
        if ctx.audit == AUDIT_OFF or any(is_compiled(m) for m in ctx.models):
            return None
        return cls(ctx, ctx.audit)

    def attach(self) -> None:
        # a model's forward, or its children's (a VAE's encode() calls its encoder, not its forward)
        starts = {id(m): m for model, _ in self._models for m in (model, *model.children())}
        self._handles = [m.register_forward_pre_hook(self._forward_starts) for m in starts.values()]

    def set_sampling(self, active: bool) -> None:
        """The previous step ended (or the watch attached): an audited step starts here, so that what the loop does
        before the forward (casting timesteps, building a schedule) is audited too."""
        self._sampled = active
        if self._boundary:
            self._maybe_start(None)
        self._boundary = True   # the first call is the attach, maybe in the middle of a step

    def _due(self, step: int, whole: bool) -> bool:
        """Whether ``step`` is audited; ``whole``: it starts at a step boundary (else at a forward: what the loop did
        before it is not seen)."""
        if step in self._audited:
            return False
        if self.policy == AUDIT_AUTO:   # the first sampled step, the first whole one, and the one after an anomaly
            return (self._sampled and (not self._audited or (whole and not self._whole))) or step in self._armed
        if self.policy == "all":
            return self._sampled
        return step in self.policy

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        """A model's forward starts: the first audited step of a watch attached before the loop starts here."""
        self._maybe_start(module)

    def _maybe_start(self, module: nn.Module | None) -> None:
        if self.audit.running or self.audit.off or self._ctx is None or torch.compiler.is_compiling():
            return
        step, whole = self._ctx.steps(), module is None
        if self._due(step, whole) and self.audit.start(module):
            self._whole = self._whole or whole
            self._audited.append(step)
            self._step = step

    # ---- the step clock -------------------------------------------------------------------------------------------
    def step_starting(self) -> bool:
        self.audit.stop()   # the step's gradients are final: its optimizer's own ops are not audited
        return False

    def trouble(self, next_step: int) -> None:
        self._anomaly(next_step)

    def check(self, record: Step, partial: bool) -> None:
        loss = record.loss
        if loss is not None and loss.value is not None and loss.value != loss.value or record.skipped:
            self._anomaly(record.step + 1)

    def _anomaly(self, next_step: int) -> None:
        if self.policy == AUDIT_AUTO and not self._anomaly_seen:
            self._anomaly_seen = True
            self._armed.add(next_step)

    # ---- the host copy --------------------------------------------------------------------------------------------
    def pending(self, partial: bool) -> dict[str, torch.Tensor] | None:
        if partial:
            self.audit.stop()
        if self.audit.running:
            return None   # an audited step whose optimizer step has not started: read at the next copy
        values = self.audit.pending()
        if values is None and not self.audit.records and self._step is None:
            return None
        return {"ops": values if values is not None else torch.zeros(0)}

    def consume(self, host: dict[str, list[float]], reading: Reading) -> dict[str, Any]:
        values = host.get("ops", [])
        records = list(self.audit.records)
        step = self._step if self._step is not None else reading.step
        self._step = None
        events = self.audit.events(values)
        self._events += [(step, e) for e in events]
        self._step_flops[step] = self.audit.gemm_flops - self._flops_seen
        self._flops_seen = self.audit.gemm_flops
        for site, ulps in self.audit.worst(values, records):
            if site.module:
                self._modules[site.module] = max(self._modules.get(site.module, 0.0), ulps)
            self._worst.append(_audited(site, ulps))
        self._worst = sorted(self._worst, key=lambda op: -op.ulps)[:_WORST]
        worst = max((op.ulps for op in self._worst), default=0.0)
        return {"audit": {"ops": len(records), "worst_ulps": round(worst, 3), "events": len(events)}}

    # ---- results --------------------------------------------------------------------------------------------------
    def sections(self) -> dict[str, Any]:
        modules = tuple(sorted(self._modules.items(), key=lambda kv: -kv[1])[:_MODULES])
        return {"audit": AuditSection(tuple(self._audited), self.audit.ops, "float32", tuple(self._worst),
                                      tuple((m, round(u, 3)) for m, u in modules), len(self.findings(None)),
                                      self.audit.truncated, self.audit.gemm_flops)}

    def findings(self, summary: WatchSummary | None) -> list[Finding]:
        return audit_findings(self._events, scaled=self._scaled, step_flops=self._step_flops)

    def stop(self) -> None:
        # maybe called from inside the audit's own dispatch handler (an op failed): its modes leave at the next
        # module boundary, or at detach
        self.audit.off = True

    def detach(self) -> None:
        self.audit._leave()
        for handle in self._handles:
            handle.remove()
        self._handles, self._ctx = [], None


def audit_findings(events: list[tuple[int, Event]], *, scaled: bool, step_flops: dict[int, int]) -> list[Finding]:
    """Return the findings of the audit's ``events`` (by step), one per rule, module and op: a constant that explains
    an op's inf/NaN or zeros folds them, an op's inf/NaN or zeros fold its error, and scaled gradients that overflow
    are left to the loss scaler (``scaled``); ``step_flops``: each step's matmul FLOPs in the forward."""
    found: dict[tuple[str, str, str], Finding] = {}   # one per rule and op at a source line (or module, no line)
    constant_ops = {(step, e.index) for step, e in events if e.kind == "constant"}
    categorical = {(step, e.index) for step, e in events if e.kind in ("constant", "nonfinite", "zeros")}
    broken = [(step, e.site.module) for step, e in events if e.kind in ("constant", "nonfinite", "zeros", "integer")]
    for step, event in events:
        if event.kind == "graded" and event.site.op == "module output" and _contains(event.site.module, step, broken):
            continue   # its output is off because an op in it overflowed or lost values (whole units): that is named
        if event.kind in ("nonfinite", "zeros") and (step, event.index) in constant_ops:
            continue   # the constant explains the op's result
        if event.kind == "graded" and (step, event.index) in categorical:
            continue   # its inf, NaN or lost values say more than its error
        if event.kind == "nonfinite" and event.site.phase == "backward" and scaled:
            continue   # scaled gradients that overflow are the loss scaler's to skip (AMP604)
        finding = _finding(step, event, step_flops.get(step, 0))
        if finding is None:
            continue
        site = event.site
        key = (finding.code, site.op, site.where or finding.where)
        kept = found.get(key)
        if kept is None or (kept.where == "(outside any module)" != finding.where):   # the one that names a module
            found[key] = finding
    return list(found.values())


def _contains(module: str, step: int, broken: list[tuple[int, str]]) -> bool:
    """Whether ``module`` (a label) is, or holds, a module where an op overflowed or lost values at ``step``."""
    return any(s == step and (m == module or m.startswith(module + ".") or module == "(root)") for s, m in broken)


def _finding(step: int, event: Event, flops_of_step: int) -> Finding | None:
    rule, site = get_rule(_CODES[event.kind]), event.site
    where, severity = site.module_text(), None
    if event.kind == "constant":
        after = event.numbers.get("nan_after")
        zeroed = event.numbers.get("zeros_out") and event.numbers.get("held") == 0
        if after is None and not zeroed:
            return None   # the constant did no harm in this step (no NaN/inf after it, no zeros it let through)
        detail = f"{event.text} at {site.where}" if site.where else event.text
        detail += f"; NaN/inf follows in {after}" if after else "; its result holds zeros the constant was to prevent"
        severity = Severity.ERROR if after else None
    elif event.kind == "fp32-gemm":
        flops = event.numbers.get("flops", 0)
        share = f", {flops / flops_of_step:.0%} of the step's matmul and convolution FLOPs in the forward" \
            if flops_of_step else ""
        detail = f"{site.describe()} {event.text}: {flops:,} FLOPs{share}"
    elif event.kind == "recompute":
        detail = f"{site.module_text()} at {site.where}: {event.text}" if site.where else event.text
    elif site.op == "module output":
        called = f"called at {site.where}, " if site.where else ""
        detail = f"its output ({called}{site.dtype}) {event.text}"
    else:
        detail = f"{site.describe()} ({site.phase}, {site.dtype}) {event.text}"
    return rule.finding(where, detail, step, severity=severity)


def _audited(site: Site, ulps: float) -> AuditedOp:
    return AuditedOp(site.op, site.phase, site.dtype, site.module, site.where, round(ulps, 3))


def audit(model: nn.Module, batch_fn: Callable[..., Any], *, steps: int = 1, fp32_against_fp64: bool = False) -> Report:
    """Audit ``steps`` forward and backward passes of ``model`` outside a training loop: each fp16/bf16 op re-run in
    fp32 from its own inputs (AMP701 to AMP706, AMP708), as ``ampdoctor run`` audits a training step.

    ``batch_fn`` runs the forward: called with the model (``batch_fn(model) -> loss``) when it takes an argument,
    else with none; what it returns is the loss (a tensor that requires grad), or a batch the model is called on
    (a tuple as positional arguments, a dict as keyword arguments), whose floating outputs are summed for the
    backward. ``fp32_against_fp64``: also re-run the fp32 ops in float64 (an fp32 model's own losses; the cost of
    an fp32 model doubles). Nothing the model holds changes: the gradients are computed with ``torch.autograd.grad`` (no
    ``.grad`` is written), its buffers (BatchNorm statistics) are put back and the random state is restored.

    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4)).half()   # a zero input: a zero row
    >>> report = audit(net, lambda m: torch.nn.functional.normalize(m(torch.zeros(2, 4).half())).float().sum())
    >>> report.codes()
    ['AMP701']
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"audit() takes the model first: an nn.Module, got {type(model).__name__}: {model!r:.60}")
    if not callable(batch_fn):
        raise UsageError(f"audit() needs batch_fn, a function that runs the forward and returns the loss (or a "
                         f"batch), got {type(batch_fn).__name__}: {batch_fn!r:.60}")
    check_every(steps, "steps")
    labels = {module: module_label(name) for name, module in model.named_modules()}
    numerics = NumericsAudit(labels, audit_fp32=fp32_against_fp64)
    reads = HostReads("audit")
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    params = [p for p in model.parameters() if p.requires_grad]
    events: list[tuple[int, Event]] = []
    worst: list[AuditedOp] = []
    flops: dict[int, int] = {}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            for step in range(steps):
                numerics.start()
                try:
                    loss = _loss_of(model, batch_fn)
                    if params and loss.requires_grad:
                        torch.autograd.grad(loss, params, allow_unused=True)
                finally:
                    numerics.stop()
                values, records = numerics.pending(), list(numerics.records)
                host = to_host(values, reads) if values is not None else []
                events += [(step, e) for e in numerics.events(host)]
                worst += [_audited(site, ulps) for site, ulps in numerics.worst(host, records)]
                flops[step] = numerics.gemm_flops - sum(flops.values())
    finally:
        with torch.no_grad():
            for buffer, kept in buffers:
                buffer.copy_(kept)
    section = AuditSection(tuple(range(steps)), numerics.ops, "float64" if fp32_against_fp64 else "float32",
                           tuple(sorted(worst, key=lambda op: -op.ulps)[:_WORST]), (), 0, numerics.truncated,
                           numerics.gemm_flops)
    findings = audit_findings(events, scaled=False, step_flops=flops)
    return Report(findings, extra=Extras(watch=WatchSummary(steps=steps, sampled_steps=steps, parts={
        "audit": replace(section, events=len(findings))})))


def _loss_of(model: nn.Module, batch_fn: Callable[..., Any]) -> torch.Tensor:
    """Run ``batch_fn`` as `audit` describes and return what to call the backward on."""
    try:
        takes_model = len(inspect.signature(batch_fn).parameters) > 0
    except (TypeError, ValueError):   # a builtin without a signature
        takes_model = False
    got = batch_fn(model) if takes_model else batch_fn()
    if isinstance(got, torch.Tensor) and got.requires_grad:
        return got if got.numel() == 1 else got.float().sum()
    out = model(*got) if isinstance(got, (tuple, list)) else model(**got) if isinstance(got, dict) else model(got)
    floats = [t.float().sum() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
              and t.requires_grad]
    if not floats:
        raise UsageError("audit(): the model's output holds no tensor that requires grad, so there is no backward "
                         "to audit; return the loss from batch_fn, e.g. lambda m: loss_fn(m(x), y)")
    return torch.stack(floats).sum()
