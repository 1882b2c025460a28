"""What a watch shows of itself: per-module roll-ups, the flight recorder's header, and the rich summary.

Everything here works on plain data (the JSON-ready dicts ``Watch.summary_data()`` returns and the host values of
the statistics); nothing touches the model, the optimizer or the scaler beyond reading a few settings.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from ampdoctor.core.findings import Finding
from ampdoctor.core.isolation import call_safely
from ampdoctor.monitor.grad_stats import COLUMNS, FORMATS, KINDS

__all__ = ["module_rollup", "log_header", "render_watch", "run_formats"]


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


def log_header(optimizer: Any, scaler: Any, *, every: int, stats: str, sample: int,
               params: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return the flight recorder's header line: versions, environment, settings, formats and the parameters.

    Args:
        optimizer: the torch optimizer that applies the updates (its class and ``fused``/``foreach`` defaults).
        scaler: the enabled GradScaler, or None.
        every, stats, sample: the watch's settings.
        params: one ``{"name", "module", "dtype", "shape"}`` dict per parameter, in the optimizer's order.
    """
    from ampdoctor import __version__
    from ampdoctor.core.environment import environment

    defaults = getattr(optimizer, "defaults", {})
    return {
        # no device facts yet: the script may not have chosen its CUDA device (they go in the end line)
        "ampdoctor": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": environment(devices=False),
        "every": every, "stats": stats, "sample": sample,
        "optimizer": {"class": type(optimizer).__name__, "fused": defaults.get("fused"),
                      "foreach": defaults.get("foreach")},
        "scaler": None if scaler is None else {"class": type(scaler).__name__,
                                               "growth_interval": _setting(scaler, "get_growth_interval"),
                                               "backoff_factor": _setting(scaler, "get_backoff_factor")},
        "formats": {f.name: {"max": f.max, "min_subnormal": f.min_subnormal, "underflow_at_most":
                             f.underflow_at_most, "overflow_above": f.overflow_above} for f in FORMATS},
        "grad_columns": list(COLUMNS),
        "params": list(params),
    }


def _setting(scaler: Any, getter: str) -> Any:
    """Return a GradScaler setting through its public getter; None when the scaler has none (or it raises)."""
    method = getattr(scaler, getter, None)
    return call_safely(method) if callable(method) else None


def run_formats(scaler: Any, param_dtypes: Sequence[str]) -> list[str]:
    """Return the simulated formats that describe this run, for the summary's columns.

    An fp16 GradScaler means fp16; bf16 parameters mean bf16; fp16 parameters fp16; fp32 parameters without a
    scaler could be either (autocast is not known here). fp8 only when parameters are fp8: real fp8 recipes scale
    each tensor, so the loss-scale simulation describes no fp8 run otherwise.

    >>> run_formats(None, ["float32"]), run_formats(None, ["bfloat16"]), run_formats(None, ["float8_e4m3fn"])
    (['fp16', 'bf16'], ['bf16'], ['fp16', 'bf16', 'e4m3', 'e5m2'])
    """
    if scaler is not None:
        chosen = ["fp16"]
    elif "bfloat16" in param_dtypes:
        chosen = ["bf16"]
    elif "float16" in param_dtypes:
        chosen = ["fp16"]
    else:
        chosen = ["fp16", "bf16"]
    if any(d.startswith("float8") for d in param_dtypes):
        chosen = ["fp16", "bf16", "e4m3", "e5m2"]
    return chosen


def render_watch(data: dict[str, Any], findings: list[Finding] | None) -> Any:
    """Return a rich renderable of ``Watch.summary_data()`` and the findings (None: shown elsewhere, say nothing)."""
    from rich import box
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
        formats = [f for f in FORMATS if f.name in data.get("formats", [f.name for f in FORMATS])]
        table = Table(title=f"gradients at step {grads.get('step')} (unscaled; global norm "
                            f"{_num(grads.get('global_norm'))})", expand=False, box=box.SIMPLE_HEAD,
                      pad_edge=False)
        table.add_column("module", overflow="fold", min_width=16, ratio=1)  # names are kept whole, wrapped
        for col in ("L2", "max|g|", "min|g|>0", "zeros", "inf/nan", *(f"{f.name} u/o" for f in formats)):
            table.add_column(col, justify="right", no_wrap=True)  # u/o: share that would underflow / overflow
        for module, s in sorted(grads["modules"].items(), key=lambda kv: -_sortable(kv[1]["l2"]))[:20]:
            if "zero_frac" not in s:  # stats="norms"
                table.add_row(module, _num(s["l2"]), _num(s["absmax"]), *["-"] * (3 + len(formats)))
                continue
            table.add_row(module, _num(s["l2"]), _num(s["absmax"]), _num(s["min_nonzero"]), f"{s['zero_frac']:.0%}",
                          str(s["nonfinite"]), *(f"{_pct(s[f.name + '_underflow'])}/{_pct(s[f.name + '_overflow'])}"
                                                 for f in formats))
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
    elif findings is not None:
        parts.append(Text("no numerical problems seen", style="green"))
    return Group(*parts)


def _sortable(value: float) -> float:
    return math.inf if not math.isfinite(value) else value


def _num(value: Any) -> str:
    """Return a statistic for the table; inf for min|g|>0 means no finite non-zero entry: nothing to show.

    >>> _num(1 / 3), _num(None), _num(math.inf)
    ('0.333', '-', '-')
    """
    return "-" if value is None or value == math.inf else f"{value:.3g}"


def _pct(value: float) -> str:
    return "0" if not value else f"{value:.1%}" if value >= 0.001 else "<0.1%"
