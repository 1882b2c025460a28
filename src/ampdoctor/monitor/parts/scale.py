"""The loss scale's part of a watch: the loss scaler's scale and skipped steps at every step (AMP603, AMP604).

``monitor.loss_scale.ScaleMonitor`` records each step's scale and found-inf flags on the device (a library's own
loss scaler: its scale and skip decision, on the host); the sampled steps' host copies read them. Where the forward
of a skipped step was looked at (the activations' entry of its line), what it showed is noted for AMP603 to say where
the inf/NaN come from.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ampdoctor.core.findings import Finding
from ampdoctor.core.records import Step, WatchSummary
from ampdoctor.monitor.loss_scale import ScaleMonitor
from ampdoctor.monitor.part import Reading, WatchContext, WatchPart, register_part

__all__ = ["ScalePart"]


@register_part
class ScalePart(WatchPart, name="scale", codes=("AMP603", "AMP604"), order=20):
    """The loss scale and skipped steps of the watch's enabled GradScaler, else of a library's own loss scaler
    (none without either)."""

    def __init__(self, monitor: ScaleMonitor) -> None:
        self.monitor = monitor

    @classmethod
    def create(cls, ctx: WatchContext) -> "ScalePart | None":
        scaler = ctx.scaler if ctx.scaler is not None else ctx.loss_scaler
        if scaler is None:
            return None
        return cls(ScaleMonitor(scaler, capacity=min(ctx.every, 1024),
                                on_error=functools.partial(ctx.fail, "scale")))

    def attach(self) -> None:
        self.monitor.attach()

    def pending(self, partial: bool) -> dict[str, torch.Tensor]:
        return self.monitor.pending()

    def news(self, values: dict[str, torch.Tensor]) -> bool:
        return "steps" in values   # the scale after the last step alone is nothing new

    def consume(self, host: dict[str, list[float]], reading: Reading) -> dict[str, Any]:
        return {"scale": self.monitor.consume(host)}

    def check(self, record: Step, partial: bool) -> None:
        """Note what the forward of a skipped step showed, for AMP603 (a look at the whole forward only)."""
        looked = record.activations
        if partial or not record.skipped or looked is None or not looked.sampled or not looked.inputs:
            return
        self.monitor.note_forward(looked.nonfinite_module, None if record.loss is None else record.loss.value)

    def sections(self) -> dict[str, Any]:
        return {"scale": self.monitor.section()}

    def findings(self, summary: WatchSummary) -> list[Finding]:
        # AMP603 names the first non-finite module as the activation look's AMP601 does (with its class)
        self.monitor.name_culprit(None if summary.activations is None else summary.activations.culprit)
        return self.monitor.findings()

    def stop(self) -> None:
        self.monitor.disabled = True

    def detach(self) -> None:
        self.monitor.detach()
