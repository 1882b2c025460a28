"""Read a flight recorder (``ampdoctor.watch(log_dir=...)``) for what the measured gradients say about fp16/bf16.

From each sampled step's gradients (read through ``ampdoctor.core.records``; magnitudes are of the unscaled
gradient): the smallest examined non-zero |g| and the abs-max per parameter, and the fp16/bf16 underflow
fractions at the loss scale of that step. From the lost updates: the measured share of updates that rounding lost
in fp16/bf16 parameters (recorded only for such parameters), per parameter over the sampled steps.

fp16 keeps ``|g| * S`` when it is at least its smallest subnormal, 2**-24, and overflows above 65504; so a layer
whose smallest gradient is ``m`` needs ``S >= 2**ceil(log2(2**-24 / m))``, and the largest gradient ``M`` allows
``S <= 2**floor(log2(65504 / M))``. Entries below ``grad_stats.FLOOR`` (2**-24) of the step's largest |g| are at
fp32's rounding level (negligible) and are not asked for. bf16's smallest subnormal is 2**-133.
"""

from __future__ import annotations

import math
from typing import Any

from ampdoctor.core.formats import BF16, FP16
from ampdoctor.core.records import read_log, read_recording
from ampdoctor.monitor.grad_stats import FLOOR

__all__ = ["read_evidence"]


def read_evidence(path: str) -> dict[str, Any]:
    """Return what the log at ``path`` says: ``fp16``, ``bf16``, ``lost_updates``, ``lines`` (sentences) and
    ``safe`` (``{"fp16": bool|None, "bf16": ..., "pure_bf16": ...}``, None where the log cannot tell)."""
    header, records, problems = read_log(path)
    if header is None:
        raise ValueError(f"{path!r} has no flight-recorder header: {'; '.join(problems[:2])}")
    recording = read_recording(header, records)
    dtypes = dict(zip(recording.header.layout.names, recording.header.dtypes))
    smallest: dict[str, float] = {}
    largest = 0.0
    underflow: dict[str, list[float]] = {"fp16": [], "bf16": []}
    scales = []
    steps = 0
    for step in recording.steps:
        params = step.gradients.params() if step.gradients is not None else {}
        if not params:
            continue
        steps += 1
        scales.append(step.gradients.loss_scale)
        step_max = max((s["absmax"] for s in params.values() if math.isfinite(s["absmax"])), default=0.0)
        largest = max(largest, step_max)
        floor = step_max * FLOOR
        for name, stats in params.items():
            low = stats.get("min_nonzero", math.nan)
            if math.isfinite(low) and low > 0:
                smallest[name] = min(smallest.get(name, math.inf), max(low, floor))
            for fmt in underflow:
                if f"{fmt}_underflow" in stats:
                    underflow[fmt].append(stats[f"{fmt}_underflow"])
    return _conclude(path, steps, smallest, largest, underflow, scales, recording.lost_by_param(), dtypes)


def _conclude(path: str, steps: int, smallest: dict[str, float], largest: float, underflow: dict[str, list[float]],
              scales: list[Any], lost: dict[str, float], dtypes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"log": path, "sampled_steps": steps, "lines": [], "safe": {}}
    lines: list[str] = out["lines"]
    if not steps:
        lines.append("the log has no gradient statistics (watch stats='full' records them on sampled steps); "
                     "nothing to say about fp16/bf16")
        out["safe"] = {"fp16": None, "bf16": None, "pure_bf16": None}
    else:
        need = {n: math.ceil(math.log2(FP16.min_subnormal / m)) for n, m in smallest.items()}
        allowed = math.floor(math.log2(FP16.max / largest)) if largest > 0 else None
        worst = sorted(need.items(), key=lambda kv: -kv[1])[:5]
        k = max(need.values(), default=0)
        recorded = [s for s in scales if s]
        fp16_u = max(underflow["fp16"], default=0.0)
        out["fp16"] = {"needed_scale_log2": k, "allowed_scale_log2": allowed, "layers": dict(worst),
                       "recorded_loss_scale": recorded[-1] if recorded else None, "underflow_at_recorded": fp16_u}
        fits = allowed is None or k <= allowed
        lines.append(f"fp16 needs a loss scale >= 2^{k} for {', '.join(n for n, _ in worst[:3]) or 'these layers'}; "
                     f"the largest gradient ({largest:.3g}) allows up to 2^{allowed}: "
                     + ("a GradScaler can find a scale that keeps all of them" if fits else
                        "no single loss scale keeps both ends; fp16 loses the smallest gradients"))
        if recorded:
            lines.append(f"at the recorded loss scale {recorded[-1]:g}, up to {fp16_u:.2%} of a layer's gradient "
                         f"entries underflowed in fp16")
        bf16_lost = [n for n, m in smallest.items() if m < BF16.underflow_at_most]
        out["bf16"] = {"underflowing_layers": bf16_lost, "smallest_gradient": min(smallest.values(), default=None)}
        lines.append("bf16 loses none of these gradients (smallest |g| "
                     f"{min(smallest.values(), default=0):.3g} >= 2^-133)" if not bf16_lost else
                     f"bf16 underflows gradients of {', '.join(bf16_lost[:3])}")
        out["safe"].update(fp16=fits, bf16=not bf16_lost)
    if lost:
        fractions = lost   # per parameter, over the sampled steps (core.records.Recording.lost_by_param)
        mean = sum(fractions.values()) / len(fractions)
        out["lost_updates"] = {"mean": mean, "params": fractions}
        kinds = sorted({str(dtypes.get(n)) for n in fractions})
        remedy = ("; pure bf16 needs fp32 master weights, Kahan summation or stochastic rounding"
                  if mean > 0.01 else "")
        lines.append(f"{', '.join(kinds)} parameters lost {mean:.1%} of their updates to rounding (measured on "
                     f"{len(fractions)} parameters){remedy}")
        out["safe"]["pure_bf16"] = mean <= 0.01
    else:
        out["lost_updates"] = None
        lines.append("pure bf16's lost updates are not in the log: they are measured only on fp16/bf16 "
                     "parameters, and this run's were fp32 (the log has no weight magnitudes or learning rate to "
                     "estimate them from); watch one short run with bf16 parameters to measure them")
        out["safe"]["pure_bf16"] = None
    return out
