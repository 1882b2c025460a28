"""Files written whole: a reader, or a crash mid-write, never sees half of one."""

from __future__ import annotations

import json
import os
from typing import Any

from ampdoctor.core.strict_json import json_text

__all__ = ["write_atomic", "write_json_atomic", "read_json"]


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` by renaming a finished temporary file next to it over it.

    The folder is created if missing. ``os.replace`` is atomic on POSIX and Windows: the old file or the new one,
    never a mix. Raises ``OSError`` as ``open`` does (the temporary file is removed then).

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "sub" / "r.json"
    >>> write_atomic(p, "{}"); p.read_text()
    '{}'
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(partial, path)
    except OSError:
        try:
            os.remove(partial)
        except OSError:
            pass
        raise


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as strict JSON to ``path`` whole (see `write_atomic`; ``core.strict_json.json_text``: inf and
    NaN as ``"inf"``, ``"-inf"``, ``"nan"``, values JSON cannot hold as plain values or text)."""
    write_atomic(path, json_text(data))


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Return the JSON object in ``path``, or None when it is missing, unreadable, not JSON or not an object.

    >>> read_json("/nonexistent/file.json") is None
    True
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None
