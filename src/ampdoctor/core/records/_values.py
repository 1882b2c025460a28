"""Values read from a file ampdoctor wrote: trusted in nothing, a field of the wrong type reads as absent."""

from __future__ import annotations

from typing import Any

__all__ = ["num", "number", "integer", "mapping", "items", "text"]


def num(value: Any) -> float | None:
    """Return a JSON number as a float (NaN and inf included), None for anything else (bools, text, 10**400)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def number(value: Any) -> int | float | None:
    """Return a JSON number as it was written (an int stays an int, a float a float, NaN and inf included), None for
    anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) else num(value)
