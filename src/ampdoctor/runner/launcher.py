"""Run a user's training script in this process, as ``__main__``, with a `Doctor` attached."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Sequence

from ampdoctor.core.callsite import is_own_file
from ampdoctor.runner.doctor import Doctor
from ampdoctor.core.report import Report



@dataclass
class RunResult:
    """What happened: the script's exit status, the report, and whether the crash was explained."""

    exit_code: int
    report: Report
    explained: bool


def run_script(path: str, args: Sequence[str] = (), doctor: Doctor | None = None) -> RunResult:
    """Run ``path`` with ``sys.argv = [path, *args]`` under ``doctor``, keeping the script's exit status.

    The script's own exception is never swallowed or changed: its traceback is printed to stderr exactly as
    Python would print it, and the exit status is 1, as with ``python script.py``.

    Raises:
        FileNotFoundError: when ``path`` is not a file.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such script: {path!r}; pass the path of a Python file, e.g. "
                                "`ampdoctor run train.py --epochs 1`")
    doctor = doctor or Doctor()
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [path, *args]
    script_dir = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, script_dir)  # what `python script.py` does
    exit_code, explained = 0, False
    try:
        with doctor:
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as exc:
                exit_code = _exit_status(exc.code)
            except KeyboardInterrupt:
                exit_code = 130
                traceback.print_exc()
            except BaseException as exc:  # the script failed: keep its traceback and status
                exit_code = 1
                traceback.print_exception(type(exc), exc, _script_frames(exc.__traceback__, path))
                explained = bool(doctor.explain(exc))
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == script_dir and saved_path0 != script_dir:
            sys.path.pop(0)
    return RunResult(exit_code, doctor.report, explained)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _script_frames(tb: TracebackType | None, path: str) -> TracebackType | None:
    """Drop runpy's and ampdoctor's own frames, so the traceback reads as `python script.py` prints it."""
    target = os.path.abspath(path)
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    start = next((i for i, t in enumerate(frames) if os.path.abspath(t.tb_frame.f_code.co_filename) == target), 0)
    kept = [t for t in frames[start:] if not is_own_file(t.tb_frame.f_code.co_filename)] or frames
    rebuilt = None
    for t in reversed(kept):
        rebuilt = TracebackType(rebuilt, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return rebuilt
