"""What a watch hands back: its findings, its JSON-ready summary, a rich renderable and a ``Report``.

``WatchResults`` is the part of ``ampdoctor.monitor.watcher.Watch`` that reads the monitors' results; it holds no
state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ampdoctor.core.findings import Finding
from ampdoctor.core.report import Report
from ampdoctor.core.views import Drawn

__all__ = ["WatchResults", "WatchView", "armed_findings", "ARMED_CODES"]

# What a monitor armed for one step reports: the first inf/NaN output or input. Its headroom (AMP606) and inf
# output gradients (AMP602, what a GradScaler's skips are for) are left to a watch with activations=True.
ARMED_CODES = ("AMP601", "AMP609")


def armed_findings(monitor: Any) -> list[Finding]:
    """Return the findings of an ``ActivationMonitor`` armed for one step (see ``ARMED_CODES``)."""
    return [f for f in monitor.findings() if f.code in ARMED_CODES]


@dataclass(frozen=True)
class WatchView(Drawn):
    """A watch's summary to show (``rich.print(w.summary())``; drawn by ``ampdoctor.ui.watch_view``).

    Attributes:
        summary: ``Watch.summary_data()``.
        findings: the watch's findings to list under it; ``[]``: say the verdict; None: shown elsewhere.
    """

    summary: dict[str, Any]
    findings: list[Finding] | None = None


class WatchResults:
    """The results half of a ``Watch`` (see there for the attributes it reads)."""

    _activations: Any
    _activation_result: Any
    _scale_monitor: Any
    _lost: Any
    _parts: Any
    _grads: Any
    _scaler: Any
    _recorder: Any
    _armed: Any
    reads: Any

    @property
    def host_syncs(self) -> int:
        """Device-to-host reads made by the watch and its parts: the sampled steps' copies, the activation monitor's."""
        return self.reads.count

    @property
    def log_path(self) -> str | None:
        """The flight recorder's file, if any."""
        return None if self._recorder is None else str(self._recorder.path)

    @property
    def last_grads(self) -> dict[str, dict[str, float]]:
        """The per-parameter gradient statistics of the last sampled step, by parameter name."""
        return self._grads.last

    @property
    def norm_history(self) -> list[tuple[int, float]]:
        """``(step, global gradient norm)`` of the sampled steps, up to 10_000."""
        return self._grads.norm_history

    def summary_data(self) -> dict[str, Any]:  # the watch's own (it reads the watch's settings)
        raise NotImplementedError

    def findings(self) -> list[Finding]:
        """Return the findings so far: AMP603/604/605/607/608 (and AMP601/602/606 with ``activations=True``)."""
        activation = self._activation_findings()
        culprit = next((f.where for f in activation if f.code == "AMP601"), None)
        out = list(self._parts.findings)
        if self._scale_monitor is not None:
            self._scale_monitor.name_culprit(culprit)
            out += self._scale_monitor.findings()
        if self._lost is not None:
            out += self._lost.findings()
        return out + activation

    def _activation_findings(self) -> list[Finding]:
        live, kept = self._activations, self._activation_result
        if live is not None:
            return armed_findings(live) if self._armed else live.findings()
        return kept[1] if kept else []

    def summary(self, findings: bool = True) -> WatchView:
        """Return the summary and (unless ``findings=False``) the findings, for ``rich.print``."""
        return WatchView(self.summary_data(), self.findings() if findings else None)

    def report(self) -> Report:
        """Return an ``ampdoctor.core.report.Report`` with the findings and ``extra={"watch": summary_data()}``."""
        report = Report(extra={"watch": self.summary_data()})   # device facts are read when it is shown
        list(map(report.add, self.findings()))
        return report
