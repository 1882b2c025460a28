"""What a watch hands back: its findings, its JSON-ready summary, a rich renderable and a ``Report``.

``WatchResults`` is the part of ``ampdoctor.monitor.watcher.Watch`` that reads the monitors' results; it holds no
state of its own.
"""

from __future__ import annotations

from typing import Any

from ampdoctor.core.findings import Finding
from ampdoctor.core.report import Report
from ampdoctor.monitor.summary import render_watch

__all__ = ["WatchResults"]


class WatchResults:
    """The results half of a ``Watch`` (see there for the attributes it reads)."""

    _activations: Any
    _activation_result: Any
    _scale_monitor: Any
    _lost: Any
    _parts: Any
    _grads: Any
    _scaler: Any

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
        return live.findings() if live is not None else (kept[1] if kept else [])

    def summary(self, findings: bool = True) -> Any:
        """Return a rich renderable of the summary and (unless ``findings=False``) the findings."""
        return render_watch(self.summary_data(), self.findings() if findings else None)

    def report(self) -> Report:
        """Return an ``ampdoctor.core.report.Report`` with the findings and ``extra={"watch": summary_data()}``."""
        report = Report(extra={"watch": self.summary_data()})   # device facts are read when it is shown
        list(map(report.add, self.findings()))
        return report
