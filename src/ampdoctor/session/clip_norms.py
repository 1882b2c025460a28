"""The pre-clip gradient norms of a run, kept on the device and read once at the end (AMP611).

``clip_grad_norm_`` returns the total norm *before* clipping. A loop that clips (``max_grad_norm``,
``gradient_clip_val``) hands the optimizer, the watch and its own gradient logs the clipped gradients, so how large
the gradients really were is only in that return value. Each clip costs a few 0-dim device ops, no host sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding
from ampdoctor.core.host_reads import to_host
from ampdoctor.monitor.grad_stats import local_tensor

CODES = ("AMP611",)   # the watch-phase rule this emits: the session records the clips, with or without a watch


class ClipNorms:
    """Accumulate what ``clip_grad_norm_(parameters, max_norm)`` calls returned.

    >>> norms = ClipNorms()
    >>> for value in (0.5, 3.0, 2.0):
    ...     norms.record(1.0, torch.tensor(value))
    >>> norms.result()
    {'max_norm': 1.0, 'calls': 3, 'clipped': 2, 'nonfinite': 0, 'peak': 3.0, 'last': 2.0}
    """

    def __init__(self) -> None:
        self.calls = 0
        self.max_norm: float | None = None
        self._sums: torch.Tensor | None = None   # [clipped, nonfinite, peak of the finite norms]
        self._last: torch.Tensor | None = None

    def record(self, max_norm: Any, norm: Any) -> None:
        """Record one call; calls that cannot clip (``max_norm=inf``: a norm computed for logging) are left out.

        Of DTensor gradients (FSDP2, tensor parallelism) the clip returns a DTensor: a replicated norm is read
        locally; a partial one (each rank's part) is left out, since reading it would take a collective."""
        if isinstance(norm, torch.Tensor) and getattr(norm, "placements", None) is not None:
            norm = local_tensor(norm)
        if not isinstance(norm, torch.Tensor) or isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
                or not math.isfinite(max_norm):
            return
        with torch.no_grad():
            value = norm.detach().reshape(()).float()
            finite = torch.isfinite(value)
            row = torch.stack([(value > max_norm).float(), (~finite).float(),
                               torch.where(finite, value, torch.zeros_like(value))])
            if self._sums is None or self._sums.device != row.device:
                self._sums = row
            else:
                self._sums = torch.cat([self._sums[:2] + row[:2], torch.maximum(self._sums[2:], row[2:])])
            self._last = value
        self.calls += 1
        self.max_norm = float(max_norm)

    def result(self) -> dict[str, Any] | None:
        """Return the counts and norms (one host sync), or None when nothing was clipped against a finite bound."""
        if self._sums is None or self._last is None:
            return None
        clipped, nonfinite, peak, last = to_host(torch.cat([self._sums, self._last.reshape(1).to(self._sums.device)]),
                                                 "clip norms")
        return {"max_norm": self.max_norm, "calls": self.calls, "clipped": int(clipped), "nonfinite": int(nonfinite),
                "peak": peak, "last": last}

    def release(self) -> None:
        self._sums = self._last = None


def clipping_finding(clipping: dict[str, Any], where: str) -> Finding:
    """Return AMP611 for the ``result()`` of a run that clipped every step, named ``where`` (how the loop asked for
    the clip).

    >>> clipping_finding({"max_norm": 1.0, "calls": 4, "clipped": 3, "nonfinite": 0, "peak": 9.5, "last": 2.0},
    ...                  "clip_grad_norm_").detail[:50]
    'clip_grad_norm_(max_norm=1) clipped 3 of 4 steps; '
    """
    nonfinite = f"; {clipping['nonfinite']} were inf/NaN" if clipping["nonfinite"] else ""
    return get_rule("AMP611").finding(where, (
        f"clip_grad_norm_(max_norm={clipping['max_norm']:g}) clipped {clipping['clipped']} of {clipping['calls']} "
        f"steps{nonfinite}; the pre-clip gradient norm reached {clipping['peak']:.4g} (last {clipping['last']:.4g}). "
        "The optimizer and the watch's gradient statistics see the clipped gradients; these are the norms before "
        "clipping."))
