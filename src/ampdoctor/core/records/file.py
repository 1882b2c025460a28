"""The flight recorder's file: JSON lines appended whole and flushed, and read back whole, torn or restarted.

Durability. Every line is written whole and flushed to the operating system (``f.write(line); f.flush()``), so a
crash or ``kill -9`` of the training process loses at most the line being written: the kernel already holds the
rest. ``os.fsync`` per line would also survive a power loss or kernel panic, but it waits for the disk (about
1-10 ms, more on network filesystems) and would cost more than the statistics themselves with ``every=1``; it is
off by default (``fsync=False``), and the file is fsynced once when the recorder closes.

Format. Lines are strict JSON objects (``core.strict_json.json_text``): an inf or NaN is the string ``"inf"``,
``"-inf"`` or ``"nan"``, which the readers turn back into the float; files written before that hold Python's ``NaN``
/ ``Infinity`` tokens, which ``json.loads`` reads as floats. What the lines hold (a header line with its schema, step
lines, an end line, a report line) is defined in ``ampdoctor.core.records``, which also reads them
(``read_recording``); this module only writes and parses the file. Reading never unpickles or evaluates anything.

Runs and ranks. A file is appended to, never truncated: a restarted job (torchrun ``--max-restarts``, a resumed
script) adds a new header line and its own steps after the earlier runs, which stay readable (`read_runs`;
`read_log` reads the last run). In a distributed job of more than one process each rank writes its own file,
``ampdoctor.rank{r}.jsonl``, so ranks never write into one file; a single process keeps ``ampdoctor.jsonl``.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ampdoctor.core.records.lines import WATCH_SCHEMA, end_line, header_line, header_problem, report_line
from ampdoctor.core.strict_json import json_text

__all__ = ["SCHEMA", "LOG_NAME", "FlightRecorder", "LogRun", "log_name", "rank_of_log", "read_log", "read_runs"]

SCHEMA = WATCH_SCHEMA  # the schema this ampdoctor writes; core.records reads the older ones too
LOG_NAME = "ampdoctor.jsonl"
_RANK_LOG = re.compile(r"^ampdoctor\.rank(\d+)\.jsonl$")


def log_name(rank: int | None = None) -> str:
    """Return the flight recorder's file name: ``ampdoctor.rank{r}.jsonl`` for a rank, else ``ampdoctor.jsonl``.

    >>> log_name(), log_name(1)
    ('ampdoctor.jsonl', 'ampdoctor.rank1.jsonl')
    """
    return LOG_NAME if rank is None else f"ampdoctor.rank{rank}.jsonl"


def rank_of_log(path: str | os.PathLike[str]) -> int | None:
    """Return the rank a per-rank file name names (``ampdoctor.rank3.jsonl`` -> 3), else ``None``."""
    match = _RANK_LOG.match(Path(path).name)
    return int(match.group(1)) if match else None


class FlightRecorder:
    """Write a header and then one JSON line per record to ``path``, flushing each line.

    Args:
        path: the file, or a directory to put the log in (created if missing): ``ampdoctor.jsonl``, or
            ``ampdoctor.rank{r}.jsonl`` in a distributed job of several processes. An existing file is appended
            to: this run starts with its own header line after the earlier runs.
        header: JSON-ready fields of the header line (``monitor.header.log_header``); ``type``, ``schema``,
            ``started`` (seconds since the epoch), ``pid``, and in a distributed job ``rank`` and ``world_size``
            are added (``core.records.header_line``).
        rank, world_size: this process's rank and the job's size in a distributed job of several processes (read
            by the caller: ``ranks.info``), else None.
        fsync: also ``os.fsync`` after every line (survives power loss; costs a disk round trip per line).

    >>> import tempfile
    >>> with FlightRecorder(tempfile.mkdtemp(), {"params": []}) as rec:
    ...     rec.write({"type": "step", "step": 0})
    >>> read_log(rec.path)[1]
    [{'type': 'step', 'step': 0}]
    """

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any], *, rank: int | None = None,
                 world_size: int | None = None, fsync: bool = False) -> None:
        target = Path(path)
        if target.suffix != ".jsonl":
            target.mkdir(parents=True, exist_ok=True)
            target = target / log_name(rank)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
        self.path = target
        self.fsync = fsync
        self.lines = 0
        self._file: IO[str] | None = open(target, "a", encoding="utf-8")
        if self._file.tell() > 0 and not _ends_with_newline(target):
            self._file.write("\n")  # an earlier run killed mid-line: its torn line stays a line of its own
        self.write(header_line(header, started=round(time.time(), 3), pid=os.getpid(), rank=rank,
                               world_size=world_size))

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line and flush it; raise ``ValueError`` once closed."""
        if self._file is None:
            raise ValueError(f"flight recorder {str(self.path)!r} is closed")
        line = json_text(record, separators=(",", ":")) + "\n"
        self._file.write(line)  # one write of the whole line: a kill leaves at most this line torn
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self.lines += 1

    def close(self, end: dict[str, Any] | None = None) -> None:
        """Write an ``end`` line of the fields ``end`` (if given; see ``core.records.end_line``), fsync once and
        close. Closing twice is a no-op."""
        if self._file is None:
            return
        try:
            if end is not None:
                self.write(end_line(**end))
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
    line = json_text(report_line(report), separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


@dataclass
class LogRun:
    """One run in a flight recorder file: its header (``None`` for lines before any header), its records, the
    problems met while reading them, and the line its header is on."""

    header: dict[str, Any] | None
    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    line: int = 1


def read_log(path: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]], list[str]]:
    """Read a flight recorder file; return ``(header, records, problems)`` of its last run.

    Args:
        path: the ``.jsonl`` file, or the directory holding ``ampdoctor.jsonl``.

    ``records`` are the step and end lines that parse. ``problems`` names, with its line number, each line that
    was skipped: a torn last line (the process stopped while writing it), a line that is not JSON or not a JSON
    object, a missing or foreign header. Only ``json.loads`` is used. A file that a restarted job appended to
    holds several runs; the earlier ones are read by `read_runs`.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
    >>> _ = p.write_text('{"type": "header", "schema": "ampdoctor.watch/1"}\\n{"type": "step", "st')
    >>> header, records, problems = read_log(p)
    >>> header["schema"], records, problems
    ('ampdoctor.watch/1', [], ['line 2: torn last line (20 bytes, no newline): the writer stopped mid-line'])
    """
    runs = read_runs(path)
    if not runs:
        return None, [], ["empty file: no header line"]
    last = runs[-1]
    return last.header, last.records, last.problems


def read_runs(path: str | os.PathLike[str]) -> list[LogRun]:
    """Read every run of a flight recorder file, oldest first (each header line starts one); see `read_log`.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
    >>> _ = p.write_text('{"type": "header", "schema": "ampdoctor.watch/1"}\\n{"type": "step", "step": 0}\\n'
    ...                  '{"type": "header", "schema": "ampdoctor.watch/1"}\\n')
    >>> [(run.line, len(run.records)) for run in read_runs(p)]
    [(1, 1), (3, 0)]
    """
    target = Path(path)
    if target.is_dir():
        target = target / LOG_NAME
    lines = target.read_bytes().split(b"\n")
    torn = lines[-1] if lines and lines[-1] else None  # text after the last newline: never finished
    complete = lines[:-1]
    runs: list[LogRun] = []
    for number, raw in enumerate(complete, start=1):
        if raw.strip():
            _read_line(runs, number, raw)
    if torn is not None:
        _read_torn_line(runs, len(complete) + 1, torn)
    return runs


_RECORD_TYPES = ("step", "end", "report")   # the lines after a header


def _run_at(runs: list[LogRun], number: int) -> LogRun:
    """Return the run that line ``number`` belongs to: the last one so far."""
    if not runs:  # lines before any header: a run without one
        runs.append(LogRun(None, line=number))
    return runs[-1]


def _read_line(runs: list[LogRun], number: int, raw: bytes) -> None:
    """Add one complete line to ``runs``: a record of the last run, a header starting a new one, or a problem."""
    try:
        item = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        _run_at(runs, number).problems.append(
            f"line {number}: not JSON ({exc.__class__.__name__}: {str(exc)[:80]}); skipped")
        return
    if not isinstance(item, dict):
        _run_at(runs, number).problems.append(f"line {number}: a JSON {type(item).__name__}, not an object; skipped")
        return
    if item.get("type") == "header":
        _start_run(runs, number, item)
        return
    if item.get("type") not in _RECORD_TYPES:   # JSON, but none of ours: said, not read as a record
        kind = f"type {str(item['type'])[:40]!r}" if "type" in item else "no 'type'"
        _run_at(runs, number).problems.append(f"line {number}: a JSON object that is no ampdoctor record ({kind}); "
                                              "skipped")
        return
    run = _run_at(runs, number)
    if run.header is None and not run.problems:
        run.problems.append(f"line {number}: the file does not start with a header line")
    run.records.append(item)


def _start_run(runs: list[LogRun], number: int, header: dict[str, Any]) -> None:
    """Start a run at the header on line ``number``, noting what is wrong with the header."""
    if len(runs) == 1 and runs[0].header is None and not runs[0].records:
        runs[0] = LogRun(header, problems=runs[0].problems, line=number)  # only garbage came before it
    else:
        runs.append(LogRun(header, line=number))
    problem = header_problem(header)
    if problem is not None:
        runs[-1].problems.append(f"line {number}: {problem}")


def _read_torn_line(runs: list[LogRun], number: int, torn: bytes) -> None:
    """Add the text after the last newline: a record cut exactly before its newline is kept, anything else is torn."""
    run = _run_at(runs, number)
    try:
        item = json.loads(torn.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        item = None
    if isinstance(item, dict) and item.get("type") != "header":  # cut exactly before its newline: whole
        run.records.append(item)
        run.problems.append(f"line {number}: no newline at the end; the record is complete and kept")
    else:
        run.problems.append(f"line {number}: torn last line ({len(torn)} bytes, no newline): "
                            f"the writer stopped mid-line")
