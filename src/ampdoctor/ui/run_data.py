"""The numbers a report page shows, taken from a flight recorder's records or a JSON report's watch summary.

A flight recorder is read through ``ampdoctor.core.records`` (its typed views, and the one per-module roll-up the
watch summary uses too), so the page shows the console's numbers. A flight recorder gives every sampled step; a
JSON report alone gives only the watch summary (the scale history, the last sampled step's gradients, the
activation roll-up), whose plain JSON values are trusted in nothing: a value of the wrong type is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ampdoctor.core.formats import FORMATS, run_formats
from ampdoctor.core.records import (
    ActivationModule,
    AuditSection,
    FirstNonfinite,
    Header,
    Recording,
    ScaleSummary,
    Step,
    WatchSummary,
)

__all__ = ["RunData", "ActivationStep", "read_run", "KINDS"]

KINDS = ("underflow", "overflow", "nonfinite")  # heatmap panels; nonfinite is a share of all entries
Series = list[tuple[int, float]]


@dataclass(frozen=True)
class ActivationStep:
    """What the activation look saw at one sampled step: the largest finite |output|, the module closest to its
    format's maximum and its ratio to it (largest activation over the largest value its dtype holds), and the first
    module with an inf/NaN output."""

    step: int
    ratio: float | None
    module: str | None
    max_abs: float | None
    nonfinite_module: str | None


@dataclass
class RunData:
    """What the page plots, one field per figure.

    Attributes:
        source: ``"log"`` (step records), ``"report"`` (a watch summary only) or ``"none"`` (nothing watched).
        sampled_steps: step records read.
        last_step: the last sampled step, or None.
        steps: the run's steps (its end line's or watch summary's count), or None where unknown (a log cut short).
        closed: the recorder wrote its end line (None: not a flight recorder).
        formats: the formats the run is measured in (``fp16``, ``bf16``, …), for the underflow/overflow panels.
        scale: ``(step, loss scale used at that step)`` where it changed, and the scale after the last step.
        skipped: the steps the GradScaler skipped.
        loss: ``(step, loss)`` of the sampled steps: the last loss given to backward (divided by a GradScaler's
            scale); non-finite values kept.
        global_norm: ``(step, unscaled global gradient L2 norm)``; non-finite values kept.
        module_norms: ``{module: [(step, L2)]}``.
        cast_steps: the steps of the heatmap's columns.
        cast: ``{"fp16_underflow": {module: [share or None per cast step]}}``; ``"nonfinite"`` likewise. Shares
            of underflow/overflow are of the finite non-zero entries examined; non-finite is of all entries.
        activations: per sampled step, what the activation look saw (`ActivationStep`).
        activation_modules: the activation monitor's per-module roll-up.
        first_nonfinite: the first non-finite forward event (module, class, step, kind, frames, op), or None.
        first_nonfinite_backward: the first non-finite gradient event, or None.
        lost: ``(step, share of sampled updates lost to rounding)``, pooled over the parameters.
        parts: the numbers of the watch's other parts (``core.records.WatchSummary.shown_parts``).
        audit_modules: per module, the largest error the numerics audit measured there (roundoff units);
            audit_worst: its table of the worst ops (``AuditSection.worst_rows``).
        notes: what the numbers come from or lack, in words (a report alone, an older log).
    """

    source: str = "none"
    sampled_steps: int = 0
    last_step: int | None = None
    steps: int | None = None
    closed: bool | None = None
    formats: list[str] = field(default_factory=list)
    scale: Series = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    loss: Series = field(default_factory=list)
    global_norm: Series = field(default_factory=list)
    module_norms: dict[str, Series] = field(default_factory=dict)
    cast_steps: list[int] = field(default_factory=list)
    cast: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    activations: list[ActivationStep] = field(default_factory=list)
    activation_modules: dict[str, ActivationModule] = field(default_factory=dict)
    first_nonfinite: FirstNonfinite | None = None
    first_nonfinite_backward: FirstNonfinite | None = None
    lost: Series = field(default_factory=list)
    parts: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)
    audit_modules: list[tuple[str, float]] = field(default_factory=list)
    audit_worst: list[tuple[str, list[str]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_run(recording: Recording | None, watch: WatchSummary | None = None) -> RunData:
    """Return the plotted numbers of a flight recorder's run (``core.records.read_recording``) or of a report's watch
    summary (``Report.watch``).

    >>> from ampdoctor.core.records import read_recording
    >>> data = read_run(read_recording({"params": []}, [{"type": "step", "step": 0, "scale": {"steps": [0, 1],
    ...     "scale": 32768.0, "scale_changes": [[0, 65536.0]], "skipped": [0]}}]))
    >>> data.scale, data.skipped
    ([(0, 65536.0), (1, 32768.0)], [0])
    """
    data = RunData()
    end = None if recording is None else recording.end
    summary = (end.summary if end is not None else None) or watch
    if recording is not None and (recording.header is not None or recording.steps):
        data.source, data.closed = "log", end is not None
        _read_steps(data, recording)
        data.notes += recording.notes
    elif summary is not None:
        data.source = "report"
        data.notes.append("from the JSON report's watch summary: the scale history, the last sampled step's "
                          "gradients and the activation roll-up; a flight recorder (--log-dir) has every sampled "
                          "step")
    if summary is not None:
        _read_summary(data, summary)
    if end is not None and end.steps:
        data.steps = end.steps
    data.formats = _formats(None if recording is None else recording.header, summary)
    return data


def _formats(header: Header | None, summary: WatchSummary | None) -> list[str]:
    """The formats the run chose (the summary's); without a summary, those its header says (no autocast known)."""
    if summary is not None and summary.formats:
        return list(summary.formats)
    if header is None:
        return [f.name for f in FORMATS if f.name in ("fp16", "bf16")]
    return run_formats(bool(header.scaler), list(header.dtypes))


def _read_steps(data: RunData, recording: Recording) -> None:
    last_scale: tuple[int, float] | None = None
    for record in recording.steps:
        step = record.step
        data.sampled_steps += 1
        data.last_step = step
        if record.scale is not None:
            data.scale += record.scale.changes
            data.skipped += record.scale.skipped
            if record.scale.scale is not None and record.scale.end is not None:
                last_scale = (record.scale.end, record.scale.scale)
        _add_series(data, record)
        act = record.activations
        if act is not None and act.sampled:
            data.activations.append(ActivationStep(step, act.ratio, act.module, act.max_abs, act.nonfinite_module))
            if act.nonfinite_module is not None and data.first_nonfinite is None:
                data.first_nonfinite = FirstNonfinite.from_dict({"module": act.nonfinite_module, "step": step,
                                                                 "kind": "inf/NaN", "frames": None})
    if last_scale is not None and (not data.scale or data.scale[-1][0] < last_scale[0]):
        data.scale.append(last_scale)


def _add_series(data: RunData, record: Step) -> None:
    """Add one step record's loss, gradient norms and cast shares, and lost updates."""
    step = record.step
    if record.loss is not None and record.loss.value is not None:
        data.loss.append((step, record.loss.value))
    grads = record.gradients
    if grads is not None and grads.global_norm is not None:
        data.global_norm.append((step, grads.global_norm))
    modules = {} if grads is None else grads.modules()
    if modules:
        _add_modules(data, step, modules)
    if record.lost is not None and record.lost.fraction is not None:
        data.lost.append((step, record.lost.fraction))


def _add_modules(data: RunData, step: int, modules: dict[str, dict[str, float]]) -> None:
    """Add one step's per-module L2 norms and cast shares (``core.records.rollup``: the watch summary's numbers)."""
    index = len(data.cast_steps)
    data.cast_steps.append(step)
    for module, stats in modules.items():
        data.module_norms.setdefault(module, []).append((step, stats["l2"]))
        shares = {name: value for name, value in stats.items() if name.endswith(("_underflow", "_overflow"))}
        if "nonfinite" in stats and stats["numel"]:  # counts were computed (stats != "norms")
            shares["nonfinite"] = min(1.0, stats["nonfinite"] / stats["numel"])
        for name, share in shares.items():
            column = data.cast.setdefault(name, {}).setdefault(module, [])
            column.extend([None] * (index - len(column)))
            column.append(share)


def _read_summary(data: RunData, summary: WatchSummary) -> None:
    """Fill what step records lack (or all, for a report alone) from a watch summary."""
    if not data.scale and summary.scale is not None:
        _read_summary_scale(data, summary.scale)
    grads = summary.gradients
    if data.source == "report" and grads.step is not None:
        _read_summary_gradients(data, summary)
    acts = summary.activations
    if acts is not None:
        data.activation_modules = dict(acts.modules)
        if acts.first_nonfinite_forward is not None and acts.first_nonfinite_forward.module is not None:
            data.first_nonfinite = acts.first_nonfinite_forward
        if acts.first_nonfinite_backward is not None and acts.first_nonfinite_backward.module is not None:
            data.first_nonfinite_backward = acts.first_nonfinite_backward
    if summary.sampled_steps and not data.sampled_steps:
        data.sampled_steps = summary.sampled_steps
    data.steps = summary.steps or None
    data.parts = list(summary.shown_parts())
    audit = summary.parts.get("audit")
    if isinstance(audit, AuditSection):
        data.audit_modules = list(audit.modules)
        data.audit_worst = audit.worst_rows()


def _read_summary_scale(data: RunData, scale: ScaleSummary) -> None:
    """Take the loss-scale history, up to the scale after the last step, and the skipped steps of a summary."""
    data.scale = list(scale.history)
    if scale.current is not None and data.scale and scale.steps > data.scale[-1][0]:
        data.scale.append((scale.steps, scale.current))
    data.skipped = list(scale.skipped_steps)


def _read_summary_gradients(data: RunData, summary: WatchSummary) -> None:
    """Take the gradients of a summary's one step: the global norm, and each module's L2 and cast shares."""
    grads = summary.gradients
    step = grads.step
    if grads.global_norm is not None:
        data.global_norm.append((step, grads.global_norm))
    data.cast_steps = [step]
    for module, stats in grads.modules.items():
        data.module_norms[module] = [(step, stats.l2)]
        for name, value in stats.shares.items():
            if name.endswith(("_underflow", "_overflow")):
                data.cast.setdefault(name, {})[module] = [value]
