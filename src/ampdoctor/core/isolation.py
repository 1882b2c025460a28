"""Error isolation: ampdoctor's own failures never reach the user's training loop."""

from __future__ import annotations

import traceback
from typing import Any, Callable

from ampdoctor.core.findings import Finding, Severity


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


def internal_error_finding(exc: BaseException) -> Finding:
    """Return the AMP001 finding for ampdoctor's own failure ``exc``, with the file and line it came from.

    >>> internal_error_finding(ValueError("bad")).detail
    'ValueError: bad'
    """
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    place = f" at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}" if where else ""
    return Finding("AMP001", Severity.INFO, "ampdoctor", f"{type(exc).__name__}: {exc}{place}")
