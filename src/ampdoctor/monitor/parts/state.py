"""The state check, as a part of a watch: after each sampled step, every buffer, optimizer state and averaged copy is
finite (AMP707).

A BatchNorm's running statistics are written by the forward, also on a step the loss scaler then skips, and
optimizer state (Adam's ``exp_avg_sq``) that holds NaN writes NaN into the weights at the next step; neither is a
weight, so the gradients' and weights' checks never see them. On a sampled step this part reduces each floating
buffer of the run's models, each optimizer state tensor, each tensor of an averaged copy (an EMA, an
``AveragedModel``, as the averages' part sees them) and each watched tensor (its shard on this rank) to its largest
magnitude (``_torch.foreach.norms(..., inf)``: NaN and inf stay so) on the device; the values travel in the
step's one host copy. A state tensor whose weight is itself non-finite is left to AMP616.
"""

from __future__ import annotations

from typing import Any

import torch

from ampdoctor._torch.distributed import local_part
from ampdoctor._torch.foreach import norms
from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding
from ampdoctor.core.names import module_label
from ampdoctor.core.records import StateSection, WatchSummary
from ampdoctor.monitor.part import Reading, WatchContext, WatchPart, register_part

__all__ = ["StatePart"]


@register_part
class StatePart(WatchPart, name="state", codes=("AMP707",), order=75):
    """Buffers and optimizer state, checked finite after each sampled step."""

    def __init__(self, ctx: WatchContext) -> None:
        self._ctx: WatchContext | None = ctx
        prefixes = ctx.run_names.prefixes(ctx.models) if len(ctx.models) > 1 else [ctx.prefix] * len(ctx.models)
        # (tensor, module label, buffer name) of every floating buffer
        self._buffers: list[tuple[torch.Tensor, str, str]] = []
        for model, prefix in zip(ctx.models, prefixes):
            modules = dict(model.named_modules())
            for name, buffer in model.named_buffers():
                if buffer.is_floating_point():
                    owner, _, leaf = name.rpartition(".")
                    label = module_label(owner, prefix)
                    self._buffers.append((buffer, f"{label} ({type(modules.get(owner)).__name__})", leaf))
        self._names: list[tuple[str, str, str, int | None]] = []   # what each checked value is: kind, where, name
        self._checks = 0
        self._tensors = 0
        self._last_clean: int | None = None
        self._bad: dict[tuple[str, str], tuple[str, int, int | None, bool]] = {}   # (kind, where) -> first sight

    @classmethod
    def create(cls, ctx: WatchContext) -> "StatePart":
        return cls(ctx)

    def sampled_step_ending(self) -> None:
        ctx = self._ctx
        if ctx is None or "state" in ctx.off:
            return
        tensors, names = [], []
        for buffer, where, name in self._buffers:
            tensors.append(buffer)
            names.append(("buffer", where, name, None))
        for label, name, tensor in ctx.averaged() if ctx.averaged is not None else ():
            tensors.append(tensor)
            names.append(("average", label, name, None))
        state = getattr(ctx.optimizer, "state", {})
        for i, (param, pname) in enumerate(zip(ctx.params, ctx.names)):
            tensors.append(param)
            names.append(("weight", pname, "", i))
            for key, value in state.get(param, {}).items() if isinstance(state, dict) else ():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                    tensors.append(value)
                    names.append(("state", pname, str(key), i))
        keep = [k for k, t in enumerate(tensors) if _checkable(t)]
        tensors, names = [tensors[k] for k in keep], [names[k] for k in keep]
        self._values = _largest(tensors)
        self._names, self._tensors = names, max(self._tensors, len(names))

    def pending(self, partial: bool) -> dict[str, torch.Tensor] | None:
        values, self._values = getattr(self, "_values", None), None
        return None if values is None else {"largest": values}

    def consume(self, host: dict[str, list[float]], reading: Reading) -> dict[str, Any]:
        self._checks += 1
        largest = host.get("largest", [])
        bad = [n for n, v in zip(self._names, largest) if v != v or v in (float("inf"), float("-inf"))]
        weights = {i for kind, _, _, i in bad if kind == "weight"}
        new = 0
        for kind, where, name, i in bad:
            if kind == "weight" or (kind == "state" and i in weights):
                continue   # non-finite weights: AMP616's
            key = (kind, where)
            if key not in self._bad:
                self._bad[key] = (name, reading.step, self._last_clean, reading.skipped)
                new += 1
            elif name not in self._bad[key][0].split(", "):
                first = self._bad[key]
                self._bad[key] = (f"{first[0]}, {name}", *first[1:])
        if not bad:
            self._last_clean = reading.step
        return {"state": {"nonfinite": len(bad)}} if bad else {}

    def sections(self) -> dict[str, Any]:
        return {"state": StateSection(self._tensors, self._checks,
                                      tuple((f"{where} {name}".strip(), step)
                                            for (kind, where), (name, step, _, _) in self._bad.items()))}

    def findings(self, summary: WatchSummary) -> list[Finding]:
        rule, out = get_rule("AMP707"), []
        for (kind, where), (names, step, clean, skipped) in self._bad.items():
            what = {"buffer": f"the buffers {names}", "average": f"the averaged copy's {names}"}.get(
                kind, f"the optimizer state {names} of {where}")
            since = f" (finite after step {clean})" if clean is not None else ""
            detail = f"{what} hold inf/NaN after step {step}{since}"
            if skipped:
                detail += f"; the loss scaler skipped step {step}, but its forward still updated them: evaluation " \
                          "and every later step read them"
            out.append(rule.finding("optimizer" if kind == "state" else where, detail, step))
        return out

    def detach(self) -> None:
        self._ctx, self._buffers, self._values = None, [], None


def _checkable(tensor: torch.Tensor) -> bool:
    """A real floating tensor with entries (complex and empty ones have no largest magnitude to read)."""
    return tensor.is_floating_point() and tensor.numel() > 0


def _largest(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Return each tensor's largest magnitude (NaN and inf kept), as one float32 vector on the first one's device."""
    if not tensors:
        return None
    with torch.no_grad():
        largest = norms([local_part(t) for t in tensors], float("inf"), dtype=torch.float32)
        device = largest[0].device
        return torch.stack([n if n.device == device else n.to(device) for n in largest])
