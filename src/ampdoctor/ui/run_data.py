"""The numbers a report page shows, taken from a flight recorder's records or a JSON report's watch summary.

Everything here reads plain JSON values (``json.loads`` output) and trusts none of them: a value of the wrong type
is skipped, never raised on. A flight recorder gives every sampled step; a JSON report alone gives only the watch
summary (the scale history, the last sampled step's gradients, the activation roll-up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ampdoctor.monitor.summary import run_formats

__all__ = ["RunData", "read_run", "KINDS"]

KINDS = ("underflow", "overflow", "nonfinite")  # heatmap panels; nonfinite is a share of all entries
Series = list[tuple[int, float]]


@dataclass
class RunData:
    """What the page plots, one field per figure.

    Attributes:
        source: ``"log"`` (step records), ``"report"`` (a watch summary only) or ``"none"`` (nothing watched).
        sampled_steps: step records read.
        last_step: the last sampled step, or None.
        closed: the recorder wrote its end line (None: not a flight recorder).
        formats: the formats the run trains in (``fp16``, ``bf16``, …), for the underflow/overflow panels.
        scale: ``(step, loss scale used at that step)`` where it changed, and the scale after the last step.
        skipped: the steps the GradScaler skipped.
        global_norm: ``(step, unscaled global gradient L2 norm)``; non-finite values kept.
        module_norms: ``{module: [(step, L2)]}``.
        cast_steps: the steps of the heatmap's columns.
        cast: ``{"fp16_underflow": {module: [share or None per cast step]}}``; ``"nonfinite"`` likewise. Shares
            of underflow/overflow are of the finite non-zero entries examined; non-finite is of all entries.
        activations: per sampled step ``{"step", "ratio", "module", "nonfinite_module"}`` (ratio: largest
            activation over the largest value its dtype holds).
        activation_modules: the activation monitor's per-module roll-up.
        first_nonfinite: the first non-finite forward event (module, class, step, kind, frames, op), or None.
        first_nonfinite_backward: the first non-finite gradient event, or None.
        lost: ``(step, share of sampled updates lost to rounding)``.
    """

    source: str = "none"
    sampled_steps: int = 0
    last_step: int | None = None
    closed: bool | None = None
    formats: list[str] = field(default_factory=list)
    scale: Series = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    global_norm: Series = field(default_factory=list)
    module_norms: dict[str, Series] = field(default_factory=dict)
    cast_steps: list[int] = field(default_factory=list)
    cast: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    activations: list[dict[str, Any]] = field(default_factory=list)
    activation_modules: dict[str, dict[str, Any]] = field(default_factory=dict)
    first_nonfinite: dict[str, Any] | None = None
    first_nonfinite_backward: dict[str, Any] | None = None
    lost: Series = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def read_run(header: dict[str, Any] | None, records: list[dict[str, Any]],
             report_extra: dict[str, Any] | None = None) -> RunData:
    """Return the plotted numbers of a flight recorder (``header``, ``records``) or a report's ``extra``.

    >>> data = read_run({"params": []}, [{"type": "step", "step": 0, "scale": {"steps": [0, 1], "scale": 32768.0,
    ...     "scale_changes": [[0, 65536.0]], "skipped": [0]}}])
    >>> data.scale, data.skipped
    ([(0, 65536.0), (1, 32768.0)], [0])
    """
    data = RunData()
    steps = [r for r in records if r.get("type") == "step" and isinstance(r.get("step"), int)]
    end = next((r for r in reversed(records) if r.get("type") == "end"), None)
    summary = _dict((end or {}).get("summary")) or _dict((report_extra or {}).get("watch"))
    if header is not None or steps:
        data.source, data.closed = "log", end is not None
        _read_steps(data, header or {}, steps)
    elif summary:
        data.source = "report"
        data.notes.append("from the JSON report's watch summary: the scale history, the last sampled step's "
                          "gradients and the activation roll-up; a flight recorder (--log-dir) has every sampled "
                          "step")
    if summary:
        _read_summary(data, summary)
    data.formats = _formats(header, summary)
    return data


def _formats(header: dict[str, Any] | None, summary: dict[str, Any]) -> list[str]:
    named = [str(f) for f in _list(summary.get("formats")) if isinstance(f, str)]
    if named:
        return named
    if header is None:
        return ["fp16", "bf16"]
    dtypes = [str(_dict(p).get("dtype")) for p in _list(header.get("params"))]
    return run_formats(header.get("scaler") or None, dtypes)


def _read_steps(data: RunData, header: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    columns = [str(c) for c in _list(header.get("grad_columns"))]
    params = [_dict(p) for p in _list(header.get("params"))]
    modules = [str(p.get("module", p.get("name", "?"))) for p in params]
    last_scale: tuple[int, float] | None = None
    for record in steps:
        step = record["step"]
        data.sampled_steps += 1
        data.last_step = step
        scale = _dict(record.get("scale"))
        for change in _list(scale.get("scale_changes")):
            if isinstance(change, list) and len(change) == 2 and isinstance(change[0], int) \
                    and _num(change[1]) is not None:
                data.scale.append((change[0], float(change[1])))
        data.skipped += [s for s in _list(scale.get("skipped")) if isinstance(s, int)]
        span = _list(scale.get("steps"))
        if _num(scale.get("scale")) is not None and len(span) == 2 and isinstance(span[1], int):
            last_scale = (span[1], float(scale["scale"]))
        grads = _dict(record.get("gradients"))
        if _num(grads.get("global_norm")) is not None:
            data.global_norm.append((step, float(grads["global_norm"])))
        rows = _list(grads.get("rows"))
        if rows and columns and len(rows) == len(modules):
            _read_rows(data, step, rows, columns, modules)
        lost = _dict(record.get("lost_updates"))
        if _num(lost.get("fraction")) is not None:
            data.lost.append((step, float(lost["fraction"])))
        act = _dict(record.get("activations"))
        if act.get("sampled"):
            forward, headroom = _dict(act.get("forward")), _dict(act.get("headroom"))
            bad = forward.get("nonfinite_module")
            data.activations.append({"step": step, "ratio": _num(headroom.get("ratio")),
                                     "module": headroom.get("module"), "max_abs": _num(forward.get("max_abs")),
                                     "nonfinite_module": bad if isinstance(bad, str) else None})
            if isinstance(bad, str) and data.first_nonfinite is None:
                data.first_nonfinite = {"module": bad, "step": step, "kind": "inf/NaN", "frames": None}
    if last_scale is not None and (not data.scale or data.scale[-1][0] < last_scale[0]):
        data.scale.append(last_scale)


def _read_rows(data: RunData, step: int, rows: list[Any], columns: list[str], modules: list[str]) -> None:
    """Add one step's per-module L2 norms and cast shares, rolled up from the per-parameter rows."""
    col = {name: i for i, name in enumerate(columns)}
    sums: dict[str, dict[str, float]] = {}
    for module, row in zip(modules, rows):
        if not isinstance(row, list) or len(row) != len(columns) or not all(_num(v) is not None for v in row):
            continue
        if "has_grad" in col and not row[col["has_grad"]]:
            continue
        acc = sums.setdefault(module, {})
        acc["l2sq"] = acc.get("l2sq", 0.0) + row[col["l2"]] ** 2 if "l2" in col else math.nan
        for key in ("numel", "nonfinite", "sampled_nonzero", "sampled"):
            if key in col:
                acc[key] = acc.get(key, 0.0) + row[col[key]]
        for name, i in col.items():
            if name.endswith(("_underflow", "_overflow")):
                acc[name] = acc.get(name, 0.0) + row[i]
    if not sums:
        return
    index = len(data.cast_steps)
    data.cast_steps.append(step)
    for module, acc in sums.items():
        data.module_norms.setdefault(module, []).append((step, math.sqrt(acc["l2sq"])))
        if math.isnan(acc.get("sampled", math.nan)):  # stats="norms": no counts
            continue
        shares: dict[str, float] = {}
        nonzero = acc.get("sampled_nonzero", 0.0)
        for name, count in acc.items():
            if name.endswith(("_underflow", "_overflow")):
                shares[name] = count / nonzero if nonzero else 0.0
        if acc.get("numel"):
            shares["nonfinite"] = min(1.0, acc.get("nonfinite", 0.0) / acc["numel"])
        for name, share in shares.items():
            column = data.cast.setdefault(name, {}).setdefault(module, [])
            column.extend([None] * (index - len(column)))
            column.append(share)


def _read_summary(data: RunData, summary: dict[str, Any]) -> None:
    """Fill what step records lack (or all, for a report alone) from a watch summary."""
    scale = _dict(summary.get("scale"))
    if not data.scale:
        data.scale = [(h[0], float(h[1])) for h in _list(scale.get("history"))
                      if isinstance(h, list) and len(h) == 2 and isinstance(h[0], int) and _num(h[1]) is not None]
        current = _num(scale.get("current"))
        if current is not None and isinstance(scale.get("steps"), int) and data.scale \
                and scale["steps"] > data.scale[-1][0]:
            data.scale.append((scale["steps"], current))
        data.skipped = [s for s in _list(scale.get("skipped_steps")) if isinstance(s, int)]
    grads = _dict(summary.get("gradients"))
    if data.source == "report" and isinstance(grads.get("step"), int):
        step = grads["step"]
        if _num(grads.get("global_norm")) is not None:
            data.global_norm.append((step, float(grads["global_norm"])))
        data.cast_steps = [step]
        for module, stats in _dict(grads.get("modules")).items():
            stats = _dict(stats)
            if _num(stats.get("l2")) is not None:
                data.module_norms[str(module)] = [(step, float(stats["l2"]))]
            for name, value in stats.items():
                if name.endswith(("_underflow", "_overflow")) and _num(value) is not None:
                    data.cast.setdefault(name, {})[str(module)] = [float(value)]
    acts = _dict(summary.get("activations"))
    data.activation_modules = {str(k): _dict(v) for k, v in _dict(acts.get("modules")).items()}
    first = _dict(acts.get("first_nonfinite_forward"))
    if first.get("module") is not None:
        data.first_nonfinite = first
    backward = _dict(acts.get("first_nonfinite_backward"))
    if backward.get("module") is not None:
        data.first_nonfinite_backward = backward
    if summary.get("sampled_steps") and not data.sampled_steps:
        data.sampled_steps = int(_num(summary.get("sampled_steps")) or 0)
