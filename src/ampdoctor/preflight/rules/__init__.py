"""Pre-flight rules: pure functions over a `TrainingSetup` that yield findings.

Each check is registered under its catalog code with `@check("AMP101")`. Checks read the real objects; they never
print or mutate.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from ampdoctor.core.findings import Finding
from ampdoctor.core.training import TrainingSetup

CheckFn = Callable[[TrainingSetup], Iterable[Finding]]
CHECKS: dict[str, CheckFn] = {}


def check(code: str) -> Callable[[CheckFn], CheckFn]:
    """Register ``fn`` as the pre-flight check of catalog rule ``code``."""

    def register(fn: CheckFn) -> CheckFn:
        if code in CHECKS:
            raise ValueError(f"rule {code} already has a check: {CHECKS[code].__qualname__}")
        CHECKS[code] = fn
        return fn

    return register


MAX_LISTED = 10  # names in one finding's detail


def listing(items: Sequence[str], limit: int = MAX_LISTED) -> str:
    """Return ``"a, b, c"``, cut to ``limit`` items with a count of the rest.

    >>> listing(["a", "b", "c"], limit=2)
    'a, b and 1 more'
    """
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"
