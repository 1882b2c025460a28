"""Values read from a file ampdoctor wrote: trusted in nothing, a field of the wrong type reads as absent.

A number is a JSON number, or one of the strings ampdoctor writes for inf and NaN (``"inf"``, ``"-inf"``, ``"nan"``:
``core.strict_json``); a file written before those strings has Python's ``Infinity`` / ``NaN`` tokens, which
``json.loads`` already read as floats.
"""

from __future__ import annotations

from typing import Any

from ampdoctor.core.strict_json import nonfinite_float

__all__ = ["num", "number", "integer", "mapping", "items", "text"]


def num(value: Any) -> float | None:
    """Return a JSON number as a float (NaN and inf included, written as numbers or as ``"inf"``, ``"-inf"``,
    ``"nan"``), None for anything else (bools, other text, 10**400).

    >>> num(2), num("-inf"), num("Infinity"), num(True)
    (2.0, -inf, None, None)
    """
    if isinstance(value, str):
        return nonfinite_float(value)
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
    """Return a JSON number as it was written (an int stays an int, a float a float, NaN and inf included, as `num`
    reads them), None for anything else."""
    if isinstance(value, str):
        return nonfinite_float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) else num(value)
