"""The loss, as a part of a watch: every backward call, the loss of sampled steps, and the dropped iterations.

``monitor.backward.BackwardMonitor`` observes ``torch.autograd.backward`` and ``zero_grad()``: the loss given to
backward on sampled steps, and the backward calls whose gradients no optimizer step used (the invariants' AMP612 to
AMP615 read its section). Where the forward of a sampled step with an inf/NaN loss was looked at, what it showed is
kept with it: whether the first AMP601 explains that loss (``monitor.verdicts``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ampdoctor._compat.loss_scalers import loss_scaler_shape
from ampdoctor._torch.modules import delegate_of
from ampdoctor.core.records import Step
from ampdoctor.monitor.backward import BackwardMonitor
from ampdoctor.monitor.part import Reading, WatchContext, WatchPart, register_part

__all__ = ["LossPart"]

_LOOKS = 20   # the forwards of steps with an inf/NaN loss kept


@register_part
class LossPart(WatchPart, name="loss", codes=(), order=40):
    """The loss and the backward calls of the run, with what the forward of a step with an inf/NaN loss showed; it
    emits no finding itself: the invariants read its section (AMP610, AMP612 to AMP615: ``monitor.verdicts``)."""

    def __init__(self, monitor: BackwardMonitor) -> None:
        self.monitor = monitor
        # the looks at the forward of sampled steps whose loss was inf/NaN: (step, the first module with a non-finite
        # output; "(input)": the model's input; None: every output finite)
        self._looks: list[tuple[int, str | None]] = []

    @classmethod
    def create(cls, ctx: WatchContext) -> "LossPart":
        # the probe may be a model parameter the optimizer does not hold (a hand-written fp32 master copy)
        probes = [*ctx.params, *ctx.model.parameters()]
        owners: list[Any] = [*ctx.chain, ctx.model]   # whose zero_grad() resets the watched gradients
        while owners[-1] is not None and len(owners) < len(ctx.chain) + 4:   # the model inside DDP, compile
            owners.append(delegate_of(owners[-1]))
        shape = loss_scaler_shape(ctx.loss_scaler)   # a library's own loss scaler: its scale divides the loss
        library_scale = functools.partial(shape.scale, ctx.loss_scaler) if shape is not None else None
        return cls(BackwardMonitor(probes, ctx.scaler, on_error=functools.partial(ctx.fail, "loss"), owners=owners,
                                   library_scale=library_scale))

    def attach(self) -> None:
        self.monitor.attach()

    def set_sampling(self, active: bool) -> None:
        self.monitor.sampling = active

    def step_starting(self) -> bool:
        self.monitor.step_started()
        return self.monitor.step_discarded

    def count_every_loss(self, hidden_by: str) -> None:
        self.monitor.count_every_loss(hidden_by)

    def step_ended(self) -> None:
        self.monitor.step_ended()

    def pending(self, partial: bool) -> dict[str, torch.Tensor]:
        return self.monitor.pending()

    def consume(self, host: dict[str, list[float]], reading: Reading) -> dict[str, Any]:
        entry = self.monitor.consume(host, reading.step, reading.partial)
        return {} if entry is None else {"loss": entry}

    def check(self, record: Step, partial: bool) -> None:
        looked, loss = record.activations, record.loss
        if partial or looked is None or not looked.sampled or not looked.inputs or loss is None or loss.value is None:
            return   # no forward seen whole on this step, or no loss read
        if not math.isfinite(loss.value) and len(self._looks) < _LOOKS:   # inf/NaN: what the forward showed
            self._looks.append((record.step, looked.nonfinite_module))

    def sections(self) -> dict[str, Any]:
        return {"loss": self.monitor.section(self._looks)}

    def stop(self) -> None:
        self.monitor.disabled = True
        self.monitor.sampling = False

    def detach(self) -> None:
        self.monitor.detach()
