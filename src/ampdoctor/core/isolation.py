"""Error isolation: ampdoctor's own failures never reach the user's training loop."""

from __future__ import annotations

import traceback
from typing import Any, Callable

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding


def call_safely(fn: Callable[..., Any], *args: Any, on_error: Callable[[BaseException], None] | None = None,
                **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)``; on an ``Exception`` pass it to ``on_error`` and return None.

    An exception raised by ``on_error`` itself is dropped too: this is the last line of defence.

    >>> call_safely(lambda: 1 / 0, on_error=lambda e: print(type(e).__name__))
    ZeroDivisionError
    >>> call_safely(int, "7")
    7
    """
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # an observer, monitor or clean-up step must never break the user's call
        if on_error is not None:
            try:
                on_error(exc)
            except Exception:
                pass
        return None


def internal_error_finding(exc: BaseException, where: str = "ampdoctor", step: int | None = None,
                           after: str = "") -> Finding:
    """Return the AMP001 finding for ampdoctor's own failure ``exc`` in ``where``, with the file and line it came
    from, and ``after`` (what it means for the run) appended.

    >>> internal_error_finding(ValueError("bad")).detail
    'ValueError: bad'
    """
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    place = f" at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else ""
    return get_rule("AMP001").finding(where, f"{type(exc).__name__}: {exc}{place}{after}", step)


class StepAside:
    """The parts of one owner that are off after an internal error, each failure reported once as AMP001.

    A part that raises is switched off alone; the ``whole`` part takes every part with it. The AMP001 finding names
    the place: the owner for the whole, ``owner (part)`` for a part.

    Args:
        owner: who the parts belong to, as findings name it (``"ampdoctor"``, ``"ampdoctor.watch"``).
        record: receives each AMP001 finding (default: kept in ``findings``).
        on_fail: called with ``(part, exc)`` after a part is switched off (to stop its monitor, to say so).
        whole: the part whose failure switches every part off.
        parts: the parts ``whole`` takes with it (default: every part asked about).

    >>> aside = StepAside("ampdoctor.watch", whole="watch")
    >>> aside.guard("scale", lambda: 1 / 0), sorted(aside.off), [f.where for f in aside.findings]
    (None, ['scale'], ['ampdoctor.watch (scale)'])
    """

    def __init__(self, owner: str, record: Callable[[Finding], None] | None = None,
                 on_fail: Callable[[str, BaseException], None] | None = None, *, whole: str = "run",
                 parts: tuple[str, ...] = ()) -> None:
        self.owner, self.whole, self.parts = owner, whole, parts
        self.findings: list[Finding] = []
        self.off: set[str] = set()
        self._record = record if record is not None else self.findings.append
        self._on_fail = on_fail

    def guard(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` unless ``part`` (or the whole) is off; on an exception switch ``part`` off
        and return None."""
        if part in self.off or self.whole in self.off:
            return None
        return call_safely(fn, *args, on_error=lambda exc: self.fail(part, exc), **kwargs)

    def fail(self, part: str, exc: BaseException, step: int | None = None) -> bool:
        """Switch ``part`` off and report ``exc`` as AMP001; return False where it was off already."""
        if part in self.off or self.whole in self.off:
            return False
        self.off.add(part)
        if part == self.whole:
            self.off.update(self.parts)
        where = self.owner if part == self.whole else f"{self.owner} ({part})"
        after = "" if part == self.whole else "; this part is off for the rest of the run"
        call_safely(self._record, internal_error_finding(exc, where, step, after))
        if self._on_fail is not None:
            call_safely(self._on_fail, part, exc)
        return True
