"""Write strict JSON, with inf and NaN as the strings ``"inf"``, ``"-inf"`` and ``"nan"``, and read those back.

JSON has no number for inf or NaN. Python's ``json`` writes the tokens ``Infinity`` and ``NaN`` unless told not to;
its own ``json.loads`` reads them, but strict parsers refuse the whole file (JavaScript's ``JSON.parse``, ``jq``,
Go's ``encoding/json``, Python's ``json.loads`` with ``parse_constant`` raising), and a run whose loss or gradients
went inf/NaN, the runs ampdoctor is for, would leave a report nothing else can read. So everything ampdoctor writes
as JSON (the ``--json`` report, the flight recorder's lines, the reports ranks and child processes leave each other,
``advise --json``) goes through `json_text`: a float that is not finite becomes the string `json_float` gives,
``"inf"``, ``"-inf"`` or ``"nan"``, Python's own spelling (``str(float("inf"))``, and ``float()`` reads it back;
the op replay wrote them so first), and ``allow_nan=False`` makes a value that escaped it raise instead of writing a
bad token. Where a number is expected, a reader turns the string back into the float (`nonfinite_float`;
``core.records`` reads every field so); files written before this keep their tokens, which ``json.loads`` reads.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["json_text", "json_float", "nonfinite_float", "NONFINITE"]

NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}   # the strings written in place of the number


def json_float(value: float | None) -> float | str | None:
    """Return ``value`` as JSON can hold it: inf and NaN become ``"inf"``, ``"-inf"``, ``"nan"``.

    >>> json_float(0.5), json_float(float("-inf")), json_float(float("nan"))
    (0.5, '-inf', 'nan')
    """
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def nonfinite_float(value: Any) -> float | None:
    """Return the float one of `json_float`'s strings stands for, else None (any other value, text included).

    >>> nonfinite_float("-inf"), nonfinite_float("Infinity"), nonfinite_float(1.0)
    (-inf, None, None)
    """
    return NONFINITE.get(value) if isinstance(value, str) else None


def json_text(data: Any, **options: Any) -> str:
    """Return ``data`` as strict JSON text: inf and NaN as `json_float`'s strings, anywhere in it.

    Args:
        data: dicts, lists, tuples, strings, numbers, bools and None; a tensor or array becomes its ``tolist()``
            (a one-value tensor its number), anything else JSON cannot hold (dtypes, devices, paths) its ``str``.
        options: ``json.dumps``'s layout options (``indent``, ``separators``, ``sort_keys``).

    Raises:
        RecursionError: ``data`` contains itself.

    >>> json_text({"loss": float("nan"), "norms": [1.5, float("inf")]})
    '{"loss": "nan", "norms": [1.5, "inf"]}'
    """
    try:   # all finite, nearly always: one pass in json's C encoder
        return json.dumps(data, allow_nan=False, default=_plain, **options)
    except ValueError:   # an inf or NaN somewhere: the values are walked once, then written
        return json.dumps(_finite(data), allow_nan=False, default=lambda value: _finite(_plain(value)), **options)


def _plain(value: Any) -> Any:
    """Turn what json cannot write (tensors and arrays, dtypes, devices, paths) into plain values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _finite(value: Any) -> Any:
    """Return ``value`` with every float that is not finite, keys included, replaced by its `json_float` string."""
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, dict):
        return {(json_float(k) if isinstance(k, float) else k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
