"""The averaged copies of the weights (an EMA, an ``AveragedModel``), as a part of a watch (AMP619).

``monitor.averages.AverageMonitor`` observes the copies' update calls while the watch is attached and counts, on the
device, the sampled entries a copy had to move that it did not; the summary reads them once.
"""

from __future__ import annotations

import functools
from typing import Any

from ampdoctor.core.findings import Finding
from ampdoctor.core.records import WatchSummary
from ampdoctor.monitor.averages import AverageMonitor, average_findings
from ampdoctor.monitor.part import WatchContext, WatchPart, register_part

__all__ = ["AveragesPart"]


@register_part
class AveragesPart(WatchPart, name="averages", codes=("AMP619",), order=50):
    """The averaged copies of the run's weights whose updates round away in fp16/bf16."""

    def __init__(self, monitor: AverageMonitor) -> None:
        self.monitor = monitor
        self._stopped = False

    @classmethod
    def create(cls, ctx: WatchContext) -> "AveragesPart":
        part = cls(AverageMonitor(ctx.every, sample=ctx.sample, reads=ctx.reads,
                                  on_error=functools.partial(ctx.fail, "averages")))
        ctx.averaged = part.monitor.averaged_tensors   # the state check reads them finite
        return part

    def attach(self) -> None:
        self.monitor.attach()

    def sections(self) -> dict[str, Any]:
        return {"averages": None if self._stopped else (self.monitor.sections() or None)}

    def findings(self, summary: WatchSummary) -> list[Finding]:
        return average_findings(summary.averages or ())

    def stop(self) -> None:
        self._stopped = self.monitor.disabled = True

    def detach(self) -> None:
        self.monitor.detach()
