"""The strict-JSON check of what a test wrote: ampdoctor's JSON under its ``tmp_path`` holds no ``NaN`` or
``Infinity`` token (``ampdoctor.core.strict_json``); ``tests/conftest.py`` runs it after every test that asked for
``tmp_path``.

Only ampdoctor's files are judged: a JSON object with a report's ``schema``, a flight recorder line's ``type``, a
rank's or a child's ``report``, or the advice's ``strategies``. Text that is no JSON, or another library's file
(a transformers ``config.json``), is not ampdoctor's to judge. A test that writes the old tokens on purpose is
marked ``nonstrict_json``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

TOKENS = (b"NaN", b"Infinity")   # -Infinity contains Infinity
LARGEST = 256 * 2**20   # larger files are not read: no test writes one
_LINE_TYPES = {"header", "step", "end", "report"}


class NonstrictToken(ValueError):
    """A ``NaN``, ``Infinity`` or ``-Infinity`` token: JSON has none (JavaScript's ``JSON.parse`` refuses it)."""

    def __init__(self, token: str) -> None:
        super().__init__(f"{token} is not JSON")
        self.token = token


def _refuse(token: str) -> Any:
    raise NonstrictToken(token)


def strict_loads(text: str | bytes) -> Any:
    """Parse ``text`` as a strict parser does: ``json.loads`` with ``NaN`` and ``Infinity`` refused."""
    return json.loads(text, parse_constant=_refuse)


def nonstrict_files(folder: str | os.PathLike[str]) -> list[str]:
    """Return, for each of ampdoctor's ``*.json`` files and ``*.jsonl`` lines under ``folder`` that a strict parser
    refuses, where it is and the token: ``report.json: NaN at watch.gradients.global_norm``."""
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            if name.endswith((".json", ".jsonl")):
                found += _nonstrict(Path(root) / name)
    return found


def _nonstrict(path: Path) -> list[str]:
    try:
        if path.stat().st_size > LARGEST:
            return []
        data = path.read_bytes()
    except OSError:
        return []
    if not any(token in data for token in TOKENS):   # nearly every file: one fast scan of its bytes
        return []
    documents = [data] if path.suffix == ".json" else data.splitlines()
    found = []
    for number, document in enumerate(documents, start=1):
        if any(token in document for token in TOKENS):
            token = _token(document)
            value = _loads(document) if token else None
            if token and _ours(value):
                line = f" line {number}" if path.suffix == ".jsonl" else ""
                found.append(f"{path}{line}: {token} at {_where(value) or '?'}")
    return found


def _token(document: bytes) -> str | None:
    """Return the first non-strict token of a JSON document, None when it is strict or no JSON at all."""
    try:
        strict_loads(document)
    except NonstrictToken as exc:
        return exc.token
    except (ValueError, RecursionError):   # no JSON (UnicodeDecodeError is a ValueError): not ours to judge
        return None
    return None


def _loads(document: bytes) -> Any:
    """Parse a document whose only fault may be its tokens; None where it has another (a torn line)."""
    try:
        return json.loads(document)
    except (ValueError, RecursionError):
        return None


def _ours(value: Any) -> bool:
    """Whether parsed JSON is one of ampdoctor's: a report, a flight recorder line, a rank's or a child's report,
    the advice."""
    if not isinstance(value, dict):
        return False
    return (str(value.get("schema", "")).startswith("ampdoctor.") or value.get("type") in _LINE_TYPES
            or isinstance(value.get("report"), dict) or ("strategies" in value and "recommendation" in value))


def _where(value: Any, path: str = "") -> str | None:
    """Return the dotted path of the first float in ``value`` that is not finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(the whole document)"
    pairs = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in pairs:
        where = _where(item, f"{path}.{key}" if path else str(key))
        if where:
            return where
    return None
