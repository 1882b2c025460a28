"""Measured evidence from the watch, added to a pre-flight finding that predicted it (AMP208).

Pre-flight says that fp16 autocast without a GradScaler *can* flush small gradients to zero. When the watch ran,
it measured the gradients: their smallest non-zero magnitude, the share of entries that are exactly zero, and the
share that fp16 (at scale 1, as the unscaled backward runs) flushes to zero or keeps only as a subnormal. A
smallest |g| at fp16's smallest subnormal (2**-24 ≈ 5.96e-8) is the fingerprint of an fp16 backward that already
lost everything below it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ampdoctor.core.catalog import escalated
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.records import Stats, WatchSummary

__all__ = ["with_watch_evidence"]

_FP16_TINY = 2.0 ** -24  # fp16's smallest subnormal
_SHOWN = 3  # modules named in the evidence


def with_watch_evidence(finding: Finding, watch: WatchSummary | Mapping[str, Any] | None) -> Finding:
    """Return ``finding`` (AMP208) with what the watch measured appended to its detail; unchanged without data.

    When every sampled gradient entry is exactly 0, nothing trains: the finding becomes an error. Gradients read
    after a clip that shrank them (``pre_clip_norm`` above ``global_norm``) are not what the fp16 backward produced:
    their shares and smallest magnitude are left out.

    >>> from ampdoctor.core.records import GradientSummary, Stats
    >>> f = Finding("AMP208", Severity.WARNING, "torch.autocast", "No GradScaler.")
    >>> fc = Stats(1.0, 1.0, min_nonzero=2**-24, zero_frac=0.1, shares={"fp16_underflow": 0.25, "fp16_subnormal": 0.0})
    >>> watch = WatchSummary(gradients=GradientSummary(modules={"fc": fc}, step=9))
    >>> with_watch_evidence(f, watch).detail.split(": ", 1)[1][-40:]
    'or keeps only as subnormals 25.0% of fc.'
    """
    if finding.code != "AMP208" or watch is None:
        return finding
    grads = (watch if isinstance(watch, WatchSummary) else WatchSummary.from_dict(watch)).gradients
    modules = {m: s for m, s in grads.modules.items() if "fp16_underflow" in s.shares}
    if not modules:
        return finding
    parts = [f"The watch measured, at step {grads.step}:"]
    dead = [m for m, s in modules.items() if (s.zero_frac or 0.0) >= 1.0]
    if dead:
        everything = len(dead) == len(modules)
        parts.append(f"{'every' if everything else 'the'} gradient entry of {_names(dead)} is exactly 0 (the fp16 "
                     f"backward flushed them){': nothing trains' if everything else ''};")
    shrunk = (grads.pre_clip_norm or 0.0) / (grads.global_norm or math.inf)
    if shrunk > 1.01:   # read after a clip: the fp16 backward made them this much larger than what was read
        parts.append(f"it read the gradients after a clip had shrunk them {shrunk:.3g}-fold (norm "
                     f"{grads.pre_clip_norm:.3g} before it), so they do not show what the fp16 backward lost.")
        return _with(finding, parts, dead, modules)
    # the subnormal share includes the entries that round to 0
    lost = {m: max(s.share("fp16", "underflow"), s.share("fp16", "subnormal")) for m, s in modules.items()}
    smallest = min((s.min_nonzero if s.min_nonzero is not None else math.inf for s in modules.values()),
                   default=math.inf)
    if math.isfinite(smallest):
        at_floor = " (fp16's smallest subnormal: values below it were already flushed to 0)" \
            if abs(smallest - _FP16_TINY) <= _FP16_TINY * 1e-3 else ""
        parts.append(f"the smallest non-zero |g| is {smallest:.3g}{at_floor};")
    worst = sorted((m for m in modules if lost[m] > 0), key=lambda m: -lost[m])[:_SHOWN]
    if worst:
        parts.append("fp16 at scale 1 flushes or keeps only as subnormals "
                     + ", ".join(f"{lost[m]:.1%} of {m}" for m in worst) + ".")
    elif not dead:
        parts.append("no gradient entry is below fp16's normal range yet.")
    return _with(finding, parts, dead, modules)


def _with(finding: Finding, parts: list[str], dead: list[str], modules: dict[str, Stats]) -> Finding:
    severity = Severity.ERROR if dead and len(dead) == len(modules) else finding.severity
    return escalated(finding, severity, f"{finding.detail} {' '.join(parts).rstrip(';')}")


def _names(modules: list[str]) -> str:
    shown = ", ".join(modules[:_SHOWN])
    return shown if len(modules) <= _SHOWN else f"{shown} and {len(modules) - _SHOWN} more modules"
