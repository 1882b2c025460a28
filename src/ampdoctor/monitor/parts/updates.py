"""The optimizer's updates, as a part of a watch: on sampled steps, what each step did to the weights.

``monitor.updates.UpdateMonitor`` snapshots sampled entries of the trainable tensors around the optimizer step:
updates that rounded away in fp16/bf16 (AMP607, the ``lost_updates`` entry and section), steps that moved no entry
with a gradient and weights inf/NaN after a step (the ``updates`` entry and section, which the invariants read).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ampdoctor.core.findings import Finding
from ampdoctor.core.records import WatchSummary
from ampdoctor.monitor.part import Reading, WatchContext, WatchPart, register_part
from ampdoctor.monitor.updates import UpdateMonitor

__all__ = ["UpdatesPart"]


@register_part
class UpdatesPart(WatchPart, name="lost_updates", codes=("AMP607",), order=30):
    """What each sampled optimizer step did to the watched tensors: lost, moved, still finite."""

    def __init__(self, monitor: UpdateMonitor, optimizer: torch.optim.Optimizer) -> None:
        self.monitor, self._optimizer = monitor, optimizer   # the optimizer until detach

    @classmethod
    def create(cls, ctx: WatchContext) -> "UpdatesPart":
        named = list(zip(ctx.names, ctx.params))
        return cls(UpdateMonitor(named, sample=ctx.sample, on_error=functools.partial(ctx.fail, "lost_updates")),
                   ctx.optimizer)

    @property
    def seconds(self) -> float:   # type: ignore[override]
        return self.monitor.seconds

    def attach(self) -> None:
        # before the watch's own step hooks: without a scaler a step ends in the watch's post-hook, after this one's
        self.monitor.attach(self._optimizer)

    def set_sampling(self, active: bool) -> None:
        self.monitor.set_sampling(active)

    def pending(self, partial: bool) -> dict[str, torch.Tensor]:
        return self.monitor.pending()

    def news(self, values: dict[str, torch.Tensor]) -> bool:
        return "counts" in values   # whether the last step's weights were finite alone is nothing new

    def consume(self, host: dict[str, list[float]], reading: Reading) -> dict[str, Any]:
        lost, updates = self.monitor.consume(host, reading.step, reading.skipped)
        return {key: entry for key, entry in (("lost_updates", lost), ("updates", updates)) if entry is not None}

    def sections(self) -> dict[str, Any]:
        lost = self.monitor.lost_section()
        return {"lost_updates": lost if lost.watched else None,
                "updates": self.monitor.updates_section() if self.monitor.names else None}

    def findings(self, summary: WatchSummary) -> list[Finding]:
        return self.monitor.findings()

    def stop(self) -> None:
        # a flag, not detach(): this runs inside optimizer step hooks, and torch iterates over the hook dicts live
        # during step(), so removing a hook here would raise in the user's step()
        self.monitor.disable()

    def detach(self) -> None:
        self.monitor.detach()
        self._optimizer = None
