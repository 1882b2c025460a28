"""Error isolation inside a watch: each part that raises is reported once (AMP001) and switched off alone.

The parts of a ``Watch`` are ``gradients``, ``scale``, ``lost_updates``, ``activations``, ``recorder`` and
``watch`` (the step bookkeeping itself, which takes every monitoring part with it). ``WatchParts`` keeps which are
off (``core.isolation.StepAside``) and the findings the watch raises itself; the watch switches the part's monitor
off.
"""

from __future__ import annotations

from typing import Any, Callable

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.isolation import StepAside, call_safely

__all__ = ["WatchParts", "MONITORING"]

MONITORING = ("gradients", "scale", "lost_updates", "activations")  # what a failing "watch" part takes with it


class WatchParts:
    """Which parts of a watch are off, and the watch's own findings (AMP001 and its alarms, each reported once).

    >>> parts = WatchParts()
    >>> parts.guard("scale", lambda: 1 / 0, on_fail=lambda part, exc: parts.fail(part, exc, step=3))
    >>> sorted(parts.off), [(f.code, f.where, f.step) for f in parts.findings]
    (['scale'], [('AMP001', 'ampdoctor.watch (scale)', 3)])
    """

    def __init__(self, owner: str = "ampdoctor.watch") -> None:
        self.findings: list[Finding] = []
        self._aside = StepAside(owner, self.findings.append, whole="watch", parts=MONITORING)
        self._reported: set[tuple[str, str, str | None]] = set()

    @property
    def off(self) -> set[str]:
        """The parts switched off."""
        return self._aside.off

    def guard(self, part: str, fn: Callable[..., Any], *, on_fail: Callable[[str, BaseException], None],
              **kwargs: Any) -> Any:
        """Call ``fn(**kwargs)`` unless ``part`` is off; pass an exception to ``on_fail(part, exc)``, return None."""
        if part in self.off:
            return None
        return call_safely(fn, on_error=lambda exc: on_fail(part, exc), **kwargs)

    def fail(self, part: str, exc: BaseException, step: int) -> bool:
        """Switch ``part`` off and report ``exc`` as AMP001; return False if it was off already (nothing done)."""
        return self._aside.fail(part, exc, step)

    def report(self, code: str, severity: Severity, where: str, step: int, detail: str,
               fix: str | None = None) -> None:
        """Add a finding of rule ``code``, once per place (with ``fix`` in place of the rule's, if given)."""
        finding = get_rule(code).finding(where, detail, step, severity=severity, fix=fix)
        if finding.place not in self._reported:
            self._reported.add(finding.place)
            self.findings.append(finding)
