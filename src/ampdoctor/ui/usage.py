"""What the command line checks before it starts work: output paths, and the usage error it raises for them."""

from __future__ import annotations

import os

from ampdoctor.core.io import write_atomic

__all__ = ["UsageError", "check_log_dir", "check_writable", "write_text"]


class UsageError(Exception):
    """Bad input to a command: printed without a traceback, exit status 2."""


def check_writable(path: str, option: str) -> None:
    """Raise a usage error unless ``path`` can be written: not a folder, in a folder that exists and is writable."""
    if os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a folder; give a file name, e.g. {option} report.json")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path!r}: the folder {folder!r} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path!r} cannot be written (permission denied); choose another path")


def check_log_dir(path: str) -> None:
    """Create ``--log-dir`` now (or find it writable), so a bad one is a usage error before the run."""
    target = path if not path.endswith(".jsonl") else os.path.dirname(os.path.abspath(path))
    if os.path.exists(target) and not os.path.isdir(target):
        raise UsageError(f"--log-dir {path!r} is a file, not a folder; give a folder, e.g. --log-dir logs")
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--log-dir {path!r} cannot be created: {exc.strerror}; choose another folder") from None
    if not os.access(target, os.W_OK):
        raise UsageError(f"--log-dir {path!r} cannot be written (permission denied); choose another folder")


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole (``core.io.write_atomic``); raise a usage error that names the path and why
    it failed."""
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise UsageError(f"cannot write {path!r}: {exc.strerror}") from None
