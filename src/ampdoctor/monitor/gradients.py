"""The gradient part of a watch: statistics read on the device at the read point, then their record and alarms.

``GradientReader.read`` computes the ``GradStats`` rows of a sampled step on the device (no host sync); the watch
copies ``pending()`` to the host with everything else and hands the values to ``consume()``, which builds the
step record's ``"gradients"`` entry. The alarms on it:

* AMP608: the global gradient norm is not finite and no GradScaler skipped the step.
* AMP605: with a GradScaler, at least ``UNDERFLOW_FRACTION`` of a parameter's non-zero gradients would flush to 0
  in fp16 at the loss scale, or at least ``SUBNORMAL_FRACTION`` are fp16 subnormals (below 2**-14 after scaling).
  Gradients an fp16 backward computed have already lost the values that rounded to 0 (they are zeros now), so for
  them the subnormal share is the visible edge of the loss.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch

from ampdoctor.core.findings import Severity
from ampdoctor.monitor.grad_stats import COLUMNS, GradStats, rows_to_dicts

__all__ = ["GradientReader", "UNDERFLOW_FRACTION", "SUBNORMAL_FRACTION", "gradient_record", "gradient_alarms"]

UNDERFLOW_FRACTION = 0.01
SUBNORMAL_FRACTION = 0.10
NORM_HISTORY = 10_000  # sampled steps whose global norm is kept


class GradientReader:
    """Read the gradient statistics of the watched parameters on a sampled step, and keep their latest values.

    Args:
        params: the parameters whose ``.grad`` is read, in the optimizer's order.
        names: their names, one per parameter.
        stats: ``"norms"``, ``"full"`` or ``"exact"`` (see ``Watch``).
        sample: entries per parameter for the counts (``"full"``).

    >>> w = torch.nn.Parameter(torch.ones(3)); w.grad = torch.full((3,), 2.0)
    >>> reader = GradientReader([w], ["w"], stats="norms", sample=16)
    >>> reader.read(None, scaled=False)
    >>> host = {k: t.reshape(-1).tolist() for k, t in reader.pending().items()}
    >>> round(reader.consume(host, step=0)["global_norm"], 4), reader.norm_history
    (3.4641, [(0, 3.4641016151377544)])
    """

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], *, stats: str, sample: int) -> None:
        self.names = list(names)
        self._params = list(params)
        self._stats = GradStats([p.numel() for p in params], sample=None if stats == "exact" else sample,
                                counts=stats != "norms")
        self._pending: torch.Tensor | None = None
        self._loss_scale: torch.Tensor | None = None  # the loss scale the pending statistics assumed
        self._read = "none"
        self._clip: torch.Tensor | None = None  # [the clip's returned pre-clip norm, 1 if it clipped scaled grads]
        self.last: dict[str, dict[str, float]] = {}  # per-parameter statistics of the last consumed step
        self.last_pre_clip: float | None = None       # the norm the last clip returned, before clipping
        self.norm_history: list[tuple[int, float]] = []  # (step, global norm) of sampled steps, up to NORM_HISTORY

    def read(self, scale: torch.Tensor | None, scaled: bool) -> None:
        """Compute this step's statistics on the device; ``scaled``: the gradients still carry ``scale``.

        Only the first read of a step counts (two ``scaler.step`` calls would raise anyway).
        """
        if self._pending is not None:
            return
        self._pending = self._stats.compute([p.grad for p in self._params], scale, scaled)
        self._loss_scale = None if scale is None else scale.detach().reshape(1).clone()
        self._read = "scaled" if scaled else "unscaled"

    def note_clip(self, total_norm: Any, scaled: bool) -> None:
        """Keep the norm a clipping call returned (the norm before clipping) and whether it clipped scaled grads."""
        if isinstance(total_norm, torch.Tensor) and total_norm.numel() == 1:
            flag = torch.full((1,), float(scaled), device=total_norm.device)
            self._clip = torch.cat([total_norm.detach().reshape(1).float(), flag])

    def pending(self) -> dict[str, torch.Tensor]:
        """Return the device values read since the last ``consume()``: ``rows``, ``scale``, ``clip`` (``{}``)."""
        if self._pending is None:
            return {}
        out = {"rows": self._pending}
        if self._loss_scale is not None:
            out["scale"] = self._loss_scale
        if self._clip is not None:
            out["clip"] = self._clip
        return out

    def clear(self) -> None:
        """Drop what was read and not consumed."""
        self._pending = self._loss_scale = self._clip = None

    def release(self) -> None:
        """Drop the references to the parameters and to pending values; the results stay."""
        self._params = []
        self.clear()

    def summary(self, modules: dict[str, dict[str, float]]) -> dict[str, Any]:
        """Return the JSON-ready summary: the last step's statistics by parameter and by module, and the norms."""
        out: dict[str, Any] = {"params": self.last, "modules": modules}
        if self.last_pre_clip is not None:
            out["pre_clip_norm"] = self.last_pre_clip
        if self.norm_history:
            step, norm = self.norm_history[-1]
            peak = max(self.norm_history, key=lambda sn: sn[1] if math.isfinite(sn[1]) else -1.0)
            out.update(step=step, global_norm=norm, max_global_norm={"step": peak[0], "value": peak[1]})
        return out

    def consume(self, values: dict[str, list[float]], step: int) -> dict[str, Any]:
        """Take the host copy of ``pending()``; return the step record's ``"gradients"`` entry."""
        record, self.last = gradient_record(values, self.names, self._read)
        if "clip" in values:
            # clip_grad_norm_ returns the norm before clipping; on still-scaled gradients it carries the scale
            record["pre_clip_norm"], record["clipped_scaled"] = values["clip"][0], values["clip"][1] > 0
        self.last_pre_clip = record.get("pre_clip_norm")
        total = record["global_norm"]
        if total is not None and len(self.norm_history) < NORM_HISTORY:
            self.norm_history.append((step, total))
        return record


def gradient_record(values: dict[str, list[float]], names: Sequence[str],
                    read: str) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """Return the step record's ``"gradients"`` entry and the per-parameter statistics by name.

    Args:
        values: the host copy of the pending statistics: ``"rows"`` (flat, ``len(COLUMNS)`` per parameter) and,
            if known, ``"scale"`` (the loss scale the statistics assumed).
        names: the parameter names, one per row.
        read: how the gradients were read: ``"scaled"``, ``"unscaled"``.

    >>> record, params = gradient_record({"rows": [0.0] * len(COLUMNS), "scale": [1024.0]}, ["w"], "scaled")
    >>> record["read"], record["loss_scale"], record["global_norm"], params  # "w" had no gradient
    ('scaled', 1024.0, None, {})
    """
    width = len(COLUMNS)
    flat = values["rows"]
    rows = [flat[i:i + width] for i in range(0, len(flat), width)]
    params = rows_to_dicts(rows, names)
    norms = [s["l2"] for s in params.values()]
    total = math.sqrt(sum(n * n for n in norms)) if norms else None
    scale = values.get("scale")
    return {"read": read, "loss_scale": scale[0] if scale else None, "global_norm": total, "rows": rows}, params


def gradient_alarms(record: dict[str, Any], params: dict[str, dict[str, float]], step: int, *, scaler: bool,
                    stats: str) -> Iterator[tuple[str, Severity, str, str]]:
    """Yield ``(code, severity, where, detail)`` for the alarms a step record raises (AMP608, AMP605).

    Args:
        record: the step record, with ``"gradients"`` from :func:`gradient_record` and ``"scale"`` if any.
        params: the per-parameter statistics of that record.
        step: the step number.
        scaler: whether the watch has a GradScaler (AMP605 is about the loss scale).
        stats: the watch's statistics level; ``"norms"`` has no counts, so no AMP605.
    """
    grads = record.get("gradients")
    if not grads or grads["global_norm"] is None:
        return
    skipped = step in (record.get("scale") or {}).get("skipped", [])
    if not math.isfinite(grads["global_norm"]) and not skipped:
        bad = [n for n, s in params.items() if not math.isfinite(s["l2"])]
        yield ("AMP608", Severity.WARNING, ", ".join(bad[:3]) + (" …" if len(bad) > 3 else ""),
               f"global gradient norm {grads['global_norm']} at step {step} and the step was not skipped "
               f"(no GradScaler skipped it); {len(bad)} parameter(s) with non-finite gradients")
    if not scaler or stats == "norms" or grads.get("clipped_scaled"):
        return  # clipping the still-scaled gradients shrank them by the scale: their underflow is an artefact
    scale = grads.get("loss_scale")
    flagged = [(s["fp16_underflow"], s["fp16_subnormal"], n) for n, s in params.items()
               if s.get("fp16_underflow", 0.0) >= UNDERFLOW_FRACTION
               or s.get("fp16_subnormal", 0.0) >= SUBNORMAL_FRACTION]
    for under, subnormal, name in sorted(flagged, reverse=True)[:5]:
        yield ("AMP605", Severity.WARNING, name,
               f"{under:.1%} of the non-zero gradient entries would round to 0 in fp16 and {subnormal:.1%} "
               f"are fp16 subnormals at loss scale {'?' if scale is None else f'{scale:g}'}; smallest "
               f"non-zero |grad| {params[name]['min_nonzero']:.3g}. fp16's smallest subnormal is "
               f"2**-24 ≈ 6e-8 and its smallest normal 2**-14 ≈ 6.1e-5, after scaling")
