"""The gradients' part of a watch: their statistics at a sampled step's read point, their alarms (AMP605, AMP608),
and which trainable tensors got a gradient (AMP617's numbers).

The statistics are computed on the device by ``monitor.gradients.GradientReader`` when the watch's step clock says
the gradients are final (`GradientsPart.read_point`), copied in the step's one host copy, and turned into the step
line's ``gradients`` entry; the alarms read that line (``monitor.gradients.gradient_alarms``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ampdoctor._torch.scaler import is_enabled
from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.records import Step, WatchSummary
from ampdoctor.explanations.fixes import nonfinite_grads_fix
from ampdoctor.monitor.gradients import GradientReader, gradient_alarms
from ampdoctor.monitor.part import Reading, WatchContext, WatchPart, register_part

__all__ = ["GradientsPart"]


@register_part
class GradientsPart(WatchPart, name="gradients", codes=("AMP605", "AMP608"), order=10):
    """The gradient statistics of the watched tensors on sampled steps, and their alarms."""

    def __init__(self, ctx: WatchContext) -> None:
        self.reader = GradientReader(ctx.params, ctx.names, stats=ctx.stats, sample=ctx.sample,
                                     layouts=ctx.layouts or None, padding=ctx.padding or None)
        self.reader.unsummarised.update(ctx.left_out)   # an optimizer that held no tensor: say why
        self._scaler, self._stats, self._dtypes = ctx.scaler, ctx.stats, ctx.dtypes
        self._modules, self._owners, self._ran, self._off = ctx.modules, ctx.owners, ctx.ran, ctx.off
        self._alarms: list[Finding] = []
        self._reported: set[tuple[str, str, str | None]] = set()
        self.seconds = 0.0

    @classmethod
    def create(cls, ctx: WatchContext) -> "GradientsPart":
        return cls(ctx)

    @property
    def collective(self) -> bool:
        """Whether sampled steps issue collectives (sharded gradients merged over the ranks)."""
        return self.reader.reduces

    def read_point(self, scale: torch.Tensor | None, scaled: bool) -> None:
        start = time.perf_counter()
        self.reader.read(scale, scaled)
        self.seconds += time.perf_counter() - start

    def clipped(self, total_norm: Any, scaled: bool) -> None:
        self.reader.note_clip(total_norm, scaled)

    def sampled_step_ending(self) -> None:
        self.reader.finish()   # every rank, every sampled step, even with this part off: its collectives are shared

    def pending(self, partial: bool) -> dict[str, torch.Tensor] | None:
        values = self.reader.pending()
        self.reader.clear()   # what the copy holds is handed over; the next read starts anew
        return values or None

    def consume(self, host: dict[str, list[float]], reading: Reading) -> dict[str, Any]:
        return {"gradients": self.reader.consume(host, reading.step)}

    def check(self, record: Step, partial: bool) -> None:
        """AMP608 and AMP605 of the step line (``monitor.gradients.gradient_alarms``)."""
        reader, scaler = self.reader, self._scaler
        # whether the step was skipped is unknown with the scale part off (its own error) or a step that never
        # ended (partial: read at detach, e.g. after a crash inside it): then no AMP608
        skips = not partial and (scaler is None or "scale" not in self._off)
        for code, severity, where, detail in gradient_alarms(
                record, reader.last_rows, reader.names, scaler=scaler is not None, stats=self._stats,
                skips_known=skips, own_nonfinite=reader.own_nonfinite):
            # AMP608's own fix unscales with a GradScaler; this run may have none: the fix that fits it
            fix = nonfinite_grads_fix(is_enabled(scaler), self._dtypes) if code == "AMP608" else None
            self._alarm(code, severity, where, record.step, detail, fix)

    def _alarm(self, code: str, severity: Severity, where: str, step: int, detail: str, fix: str | None) -> None:
        finding = get_rule(code).finding(where, detail, step, severity=severity, fix=fix)
        if finding.place not in self._reported:   # once per place
            self._reported.add(finding.place)
            self._alarms.append(finding)

    def sections(self) -> dict[str, Any]:
        return {"gradients": self.reader.summary(self._modules, self._trained())}

    def _trained(self) -> list[bool]:
        """Per watched tensor: whether it is part of what this run trains, for AMP617: it got a gradient, or it is
        a parameter of a model whose forward ran while watched or one of whose tensors got a gradient. A tensor of a
        replaced model (an optimizer built before the model was re-created) is not."""
        arrived, owners = self.reader.arrived, self._owners
        trained = self._ran | {owners[k] for k in arrived}
        return [k in arrived or (owner is not None and owner in trained) for k, owner in enumerate(owners)]

    def findings(self, summary: WatchSummary) -> list[Finding]:
        return list(self._alarms)

    def stop(self) -> None:
        self.reader.clear()

    def detach(self) -> None:
        self.reader.release()
        self._scaler = None
