"""What an entry point checks before the training starts: output paths, and the usage error it raises for them.

The command line prints a `UsageError` without a traceback and exits 2; ``ampdoctor.attach()`` raises it (a
``ValueError``) at the call, before the first step, not at the end of a long run."""

from __future__ import annotations

import os
import tempfile

from ampdoctor.core.io import write_atomic

__all__ = ["UsageError", "check_log_dir", "check_outputs", "check_writable", "write_text"]


class UsageError(ValueError):
    """Bad input: the command line prints it without a traceback (exit status 2)."""


def check_writable(path: str, option: str) -> None:
    """Raise a usage error unless ``path`` can be written: not a folder, in a folder that exists and is writable."""
    if os.path.isdir(path):
        raise UsageError(f"{_given(option, path)} is a folder; give a file name, "
                         f"e.g. {_given(option, 'report.json', example=True)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{_given(option, path)}: the folder {folder!r} does not exist; create it first")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{_given(option, path)} cannot be written (permission denied); choose another path")
    failed = _cannot_write_in(folder)
    if failed:
        raise UsageError(f"{_given(option, path)} cannot be written ({failed}); choose another path")


def _cannot_write_in(folder: str) -> str | None:
    """Write and remove a file in ``folder`` as the report will be written (``write_atomic``: a file beside the
    target, renamed): return why that fails, or None. Permission bits say nothing as root or on /sys, /proc or a
    read-only mount; writing does."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ampdoctor-probe-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def check_log_dir(path: str, option: str = "--log-dir") -> None:
    """Create ``--log-dir`` now (or find it writable), so a bad one is a usage error before the run."""
    target = path if not path.endswith(".jsonl") else os.path.dirname(os.path.abspath(path))
    if os.path.exists(target) and not os.path.isdir(target):
        raise UsageError(f"{_given(option, path)} is a file, not a folder; give a folder, "
                         f"e.g. {_given(option, 'logs', example=True)}")
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{_given(option, path)} cannot be created: {exc.strerror}; choose another folder") from None
    failed = _cannot_write_in(target)
    if failed:
        raise UsageError(f"{_given(option, path)} cannot be written ({failed}); choose another folder")


def check_outputs(json_path: str | None, log_dir: str | None, json_option: str, log_dir_option: str) -> None:
    """Check a run's two outputs before it starts: the JSON report's path and the flight recorder's folder."""
    if json_path:
        check_writable(json_path, json_option)
    if log_dir:
        check_log_dir(log_dir, log_dir_option)


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole (``core.io.write_atomic``); raise a usage error that names the path and why
    it failed."""
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise UsageError(f"cannot write {path!r}: {exc.strerror}") from None


def _given(option: str, value: str, example: bool = False) -> str:
    """How a value is given: ``--json 'r.json'`` on the command line (an example unquoted), ``json_path='r.json'``
    to a function.

    >>> _given("--json", "r.json"), _given("--json", "r.json", example=True), _given("json_path=", "r.json")
    ("--json 'r.json'", '--json r.json', "json_path='r.json'")
    """
    if option.endswith("="):
        return f"{option}{value!r}"
    return f"{option} {value}" if example else f"{option} {value!r}"
