"""A JSON-lines flight recorder: one header line, then one line per sampled step, each flushed when written.

Durability. Every line is written whole and flushed to the operating system (``f.write(line); f.flush()``), so a
crash or ``kill -9`` of the training process loses at most the line being written: the kernel already holds the
rest. ``os.fsync`` per line would also survive a power loss or kernel panic, but it waits for the disk (about
1-10 ms, more on network filesystems) and would cost more than the statistics themselves with ``every=1``; it is
off by default (``fsync=False``), and the file is fsynced once when the recorder closes.

Format. Lines are JSON objects written by ``json.dumps``; non-finite floats use Python's ``NaN`` / ``Infinity`` /
``-Infinity`` tokens, which ``json.loads`` reads back. The first line has ``"type": "header"`` and
``"schema": "ampdoctor.watch/1"``; step lines have ``"type": "step"``; a clean close writes ``"type": "end"``.
Reading never unpickles or evaluates anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

__all__ = ["SCHEMA", "LOG_NAME", "FlightRecorder", "read_log"]

SCHEMA = "ampdoctor.watch/1"
LOG_NAME = "ampdoctor.jsonl"


class FlightRecorder:
    """Write a header and then one JSON line per record to ``path``, flushing each line.

    Args:
        path: the file, or a directory to put ``ampdoctor.jsonl`` in (created if missing). An existing file is
            replaced: one file holds one run.
        header: JSON-ready fields of the header line; ``type`` and ``schema`` are added.
        fsync: also ``os.fsync`` after every line (survives power loss; costs a disk round trip per line).

    >>> import tempfile
    >>> with FlightRecorder(tempfile.mkdtemp(), {"params": []}) as rec:
    ...     rec.write({"type": "step", "step": 0})
    >>> read_log(rec.path)[1]
    [{'type': 'step', 'step': 0}]
    """

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any], *, fsync: bool = False) -> None:
        target = Path(path)
        if target.suffix != ".jsonl":
            target.mkdir(parents=True, exist_ok=True)
            target = target / LOG_NAME
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
        self.path = target
        self.fsync = fsync
        self.lines = 0
        self._file: IO[str] | None = open(target, "w", encoding="utf-8")
        self.write({"type": "header", "schema": SCHEMA, **header})

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line and flush it; raise ``ValueError`` once closed."""
        if self._file is None:
            raise ValueError(f"flight recorder {str(self.path)!r} is closed")
        line = json.dumps(record, separators=(",", ":"), default=_jsonable) + "\n"
        self._file.write(line)  # one write of the whole line: a kill leaves at most this line torn
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self.lines += 1

    def close(self, end: dict[str, Any] | None = None) -> None:
        """Write an ``end`` line (if given), fsync once and close. Closing twice is a no-op."""
        if self._file is None:
            return
        try:
            if end is not None:
                self.write({"type": "end", **end})
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
            self._file = None

    @property
    def closed(self) -> bool:
        return self._file is None

    def __enter__(self) -> "FlightRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def append_report(path: str | os.PathLike[str], report: dict[str, Any]) -> None:
    """Append the run's final report (``Report.to_dict()``) as a ``report`` line to a closed flight recorder.

    `ampdoctor report LOG` then shows the same findings and counts as the console and the JSON of that run.
    """
    line = json.dumps({"type": "report", "report": report}, separators=(",", ":"), default=_jsonable) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def _jsonable(value: Any) -> Any:
    """Turn what json cannot write (dtypes, devices, paths, tensors of one value) into plain values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def read_log(path: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]], list[str]]:
    """Read a flight recorder file; return ``(header, records, problems)``.

    Args:
        path: the ``.jsonl`` file, or the directory holding ``ampdoctor.jsonl``.

    ``records`` are the step and end lines that parse. ``problems`` names, with its line number, each line that
    was skipped: a torn last line (the process stopped while writing it), a line that is not JSON or not a JSON
    object, a missing or foreign header. Only ``json.loads`` is used.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
    >>> _ = p.write_text('{"type": "header", "schema": "ampdoctor.watch/1"}\\n{"type": "step", "st')
    >>> header, records, problems = read_log(p)
    >>> header["schema"], records, problems
    ('ampdoctor.watch/1', [], ['line 2: torn last line (20 bytes, no newline): the writer stopped mid-line'])
    """
    target = Path(path)
    if target.is_dir():
        target = target / LOG_NAME
    data = target.read_bytes()
    header: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    lines = data.split(b"\n")
    torn = lines[-1] if lines and lines[-1] else None  # text after the last newline: never finished
    complete = lines[:-1]
    for number, raw in enumerate(complete, start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            problems.append(f"line {number}: not JSON ({exc.__class__.__name__}: {str(exc)[:80]}); skipped")
            continue
        if not isinstance(item, dict):
            problems.append(f"line {number}: a JSON {type(item).__name__}, not an object; skipped")
            continue
        if item.get("type") == "header":
            if header is None:
                header = item
                if item.get("schema") != SCHEMA:
                    problems.append(f"line {number}: header schema {item.get('schema')!r}, expected {SCHEMA!r}")
            else:
                problems.append(f"line {number}: a second header; skipped")
            continue
        if header is None and not problems:
            problems.append(f"line {number}: the file does not start with a header line")
        records.append(item)
    if torn is not None:
        number = len(complete) + 1
        try:
            item = json.loads(torn.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            item = None
        if isinstance(item, dict) and item.get("type") != "header":  # cut exactly before its newline: whole
            records.append(item)
            problems.append(f"line {number}: no newline at the end; the record is complete and kept")
        else:
            problems.append(f"line {number}: torn last line ({len(torn)} bytes, no newline): "
                            f"the writer stopped mid-line")
    if header is None and not complete and torn is None:
        problems.append("empty file: no header line")
    return header, records, problems
