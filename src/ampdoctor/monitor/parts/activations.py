"""The look at the forward (and backward) pass, as a part of a watch: the first module whose output is inf/NaN.

With ``activations=True`` an ``ActivationMonitor`` looks at every module's output and output gradient on every
sampled step (AMP601, AMP602, AMP606, AMP609). Without it, one is armed for the dense start (the first steps) and,
after trouble (a skipped step, a non-finite gradient), for the steps that follow: armed, it looks at the forward
alone and reports only where the first inf/NaN arises (``ARMED_CODES``): a script that stops at its first NaN loss
has no later step. The look covers the run's other models too (a GAN's generator, a frozen fp16 teacher or VAE).

Its values travel in the sampled step's one host copy but are read at once (``immediate``): a non-finite output is
re-run (``monitor.replay``) before the next step moves the weights.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ampdoctor.core.findings import Finding
from ampdoctor.core.isolation import call_safely
from ampdoctor.core.records import Step, WatchSummary
from ampdoctor.monitor.activations import ActivationMonitor
from ampdoctor.monitor.part import Reading, WatchContext, WatchPart, register_part
from ampdoctor.monitor.watched import other_models

__all__ = ["ActivationsPart", "ARMED_CODES", "armed_findings"]

# What a monitor armed for one step reports: the first inf/NaN output or input. Its headroom (AMP606) and inf
# output gradients (AMP602, what a GradScaler's skips are for) are left to a watch with activations=True.
ARMED_CODES = ("AMP601", "AMP609")


def armed_findings(monitor: Any) -> list[Finding]:
    """Return the findings of an ``ActivationMonitor`` armed for one step (see ``ARMED_CODES``)."""
    return [f for f in monitor.findings() if f.code in ARMED_CODES]


@register_part
class ActivationsPart(WatchPart, name="activations", codes=("AMP601", "AMP602", "AMP606", "AMP609"),
                      order=60, immediate=True):
    """The activation look of a watch: on every sampled step, or armed for the dense start and after trouble."""

    def __init__(self, ctx: WatchContext) -> None:
        self._ctx: WatchContext | None = ctx
        self.monitor: ActivationMonitor | None = None
        self._last: int | None = None   # armed: the last step it looks at; None: looking at every sampled step
        # what a monitor that was disarmed or detached saw: its section and its findings
        self._kept: tuple[Any, list[Finding]] | None = None
        self._seconds = 0.0   # the forward hooks of the monitors disarmed
        self._stopped = False

    @classmethod
    def create(cls, ctx: WatchContext) -> "ActivationsPart":
        return cls(ctx)

    @property
    def seconds(self) -> float:   # type: ignore[override]
        return self._seconds + (self.monitor.seconds if self.monitor is not None else 0.0)

    # ---- attaching, arming and disarming --------------------------------------------------------------------------
    def attach(self) -> None:
        ctx = self._ctx
        if ctx is None:
            return
        if ctx.activations:
            self._start(gradients=True)
        elif ctx.dense:   # the dense start: the first non-finite output of the first steps
            self._arm(ctx.dense - 1)

    def _start(self, gradients: bool) -> None:
        ctx = self._ctx
        assert ctx is not None
        # the run's other models too: the first inf/NaN in call order may be theirs (a GAN's generator), and an input
        # of the watched model that one of them made inf is no bad data
        frozen = list(ctx.frozen()) if ctx.frozen is not None else []
        others = other_models(ctx.model, ctx.others, frozen, ctx.run_names) if len(ctx.models) > 1 or frozen else []
        self.monitor = ActivationMonitor(ctx.model, reads=ctx.reads, scaler=ctx.scaler, gradients=gradients,
                                         prefix=ctx.prefix, others=others)
        self.monitor.attach()

    def _arm(self, last: int) -> None:
        """Hook the sampled steps up to ``last``; armed, the monitor looks at the forward alone: its findings are
        the first non-finite output or input (``ARMED_CODES``)."""
        self._start(gradients=False)
        self._last = last

    def _disarm(self) -> None:
        armed, self.monitor, self._last = self.monitor, None, None
        assert armed is not None
        self._kept = (armed.section(), armed_findings(armed))
        self._seconds += armed.seconds
        armed.detach()

    def set_sampling(self, active: bool) -> None:
        if self.monitor is not None:
            self.monitor.set_sampling(active)

    # ---- a sampled step -------------------------------------------------------------------------------------------
    def pending(self, partial: bool) -> dict[str, torch.Tensor] | None:
        if self.monitor is None or partial:
            return None   # no look at this step
        return self.monitor.pending()

    def consume(self, host: dict[str, list[float]], reading: Reading) -> dict[str, Any]:
        assert self.monitor is not None
        return {"activations": self.monitor.step_record(reading.step, host.get("abs_max"))}

    def check(self, record: Step, partial: bool) -> None:
        if not partial and self._last is not None and record.step >= self._last:
            self._disarm()   # its last step is recorded: keep what it found

    def trouble(self, next_step: int) -> None:
        """A skipped step or a non-finite gradient: look at the forward of the next steps, if nothing looks yet."""
        if self.monitor is None and self._ctx is not None:
            self._arm(next_step)

    # ---- results --------------------------------------------------------------------------------------------------
    def _findings(self) -> list[Finding]:
        if self.monitor is not None:
            return armed_findings(self.monitor) if self._last is not None else self.monitor.findings()
        return self._kept[1] if self._kept else []

    def sections(self) -> dict[str, Any]:
        culprit = next((f.where for f in self._findings() if f.code == "AMP601"), None)
        if self.monitor is not None:
            return {"activations": self.monitor.section(culprit)}
        if self._kept is None:
            return {"activations": None}
        return {"activations": replace(self._kept[0], culprit=culprit)}

    def findings(self, summary: WatchSummary) -> list[Finding]:
        return self._findings()

    # ---- the end --------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopped = True
        if self.monitor is not None:
            self.monitor.set_sampling(False)

    def detach(self) -> None:
        monitor, self._ctx = self.monitor, None
        if monitor is None:
            return
        try:
            monitor.detach(record=not self._stopped)   # records the pending step, removes the hooks
        finally:   # every hook goes, also after a failure to record the last step or with the part stepped aside
            monitor.detach(record=False)
            keep = armed_findings if self._last is not None else lambda m: m.findings()
            self._kept = call_safely(lambda: (monitor.section(), keep(monitor)))
            self._seconds += monitor.seconds
            self.monitor = self._last = None
