"""tqdm internals: which progress bars are open, so that ampdoctor's lines start at column 0 and not after a bar.

A tqdm bar redraws its line with ``'\\r'`` and writes no ``'\\n'`` until it closes. Piped into a log file the bar's
states all stay on one line (``grep`` splits at ``'\\n'`` only), so a line written while a bar is open reads
``...it/s]ampdoctor --fix: ...`` and ``grep '^ampdoctor'`` misses it. On a terminal tqdm's own answer is right:
``tqdm.external_write_mode`` (what ``tqdm.write`` uses) clears the open bars (``'\\r'``, spaces, ``'\\r'``), lets the
caller write whole lines, then redraws the bars under them. In a log that clearing is more of the same line, so
there the bar's line is ended with a ``'\\n'`` instead, once: the bar draws its next state on a line of its own.

Which bars are open is tqdm's private ``tqdm._instances`` (a WeakSet of the bars not yet closed; disabled ones are
left out). Without tqdm imported, or a tqdm without ``_instances``/``external_write_mode``, nothing is cleared and
the lines are written as they are. Tested with tqdm 4.70. A log file left mid-line by something else (another
progress display, ``print(..., end="")``) gets a ``'\\n'`` first too: its last byte is read back (`_log_mid_line`).
"""

from __future__ import annotations

import io
import os
import stat
import sys
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["clear_of_bars"]

_ended: dict[int, tuple[Any, ...]] = {}   # id(file) -> the bars' state when ampdoctor last ended their line there


def _open_bars() -> tuple[Any, list[Any]]:
    """Return the tqdm class and its open, shown bars (none when tqdm is not imported: no bar can be open)."""
    bar_class = getattr(sys.modules.get("tqdm"), "tqdm", None)
    instances = getattr(bar_class, "_instances", None)
    if not instances or not callable(getattr(bar_class, "external_write_mode", None)):
        return None, []
    try:
        shown = [bar for bar in list(instances) if not getattr(bar, "disable", False) and hasattr(bar, "fp")]
    except (TypeError, RuntimeError):   # not a set, or changed by another thread while read
        return None, []
    return bar_class, shown


def _same_stream(a: Any, b: Any) -> bool:
    """Tell whether two streams end in one place (``2>&1``: stdout and stderr are one pipe or file)."""
    a, b = getattr(a, "_wrapped", a), getattr(b, "_wrapped", b)   # tqdm wraps a bar's file (DisableOnWriteError)
    if a is b:
        return True
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):   # a StringIO, or a closed stream
        return False


def _is_terminal(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):
        return False


def _state(bars: list[Any]) -> tuple[Any, ...]:
    """Return what changes when a bar draws again (its count and the time it last printed)."""
    return tuple((id(bar), getattr(bar, "n", None), getattr(bar, "last_print_t", None)) for bar in bars)


def _log_mid_line(file: Any) -> bool:
    """Tell whether ``file`` writes to a regular file (a log) whose last byte is not ``'\\n'``.

    A pipe or a terminal cannot be read back, so only a log file is looked at: its last byte is read through
    ``/proc/self/fd`` (the stream itself is open for writing only), after flushing what the stream holds. Anything
    that fails (no ``fileno``, no ``/proc``, another OS) reads as "not mid-line".
    """
    try:
        fd = file.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        file.flush()
        reader = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False
    try:
        size = os.fstat(reader).st_size
        return size > 0 and os.pread(reader, 1, size - 1) != b"\n"
    except OSError:
        return False
    finally:
        os.close(reader)


@contextmanager
def clear_of_bars(file: Any) -> Iterator[None]:
    """Let the caller write whole lines to ``file`` at column 0 while a tqdm bar is open on the same stream.

    On a terminal the bars are cleared and redrawn under the lines; elsewhere (a pipe, a log file) the bar's line
    is ended with ``'\\n'``, unless no bar has drawn since ampdoctor last ended it. With no bar open this does
    nothing. A failure of tqdm's own (a closed stream) never reaches the caller: the lines are written as they are.

    >>> import io
    >>> out = io.StringIO()
    >>> with clear_of_bars(out):
    ...     _ = out.write("ampdoctor: a line\\n")
    >>> out.getvalue()
    'ampdoctor: a line\\n'
    """
    bar_class, bars = _open_bars()
    bars = [bar for bar in bars if _same_stream(bar.fp, file)]
    if not bars:
        if _log_mid_line(file):   # another progress display (or print(..., end="")) left a log file mid-line
            try:
                file.write("\n")
            except (OSError, ValueError):
                pass
        yield
        return
    if not _is_terminal(file):
        if _ended.get(id(file)) != _state(bars):
            try:
                file.write("\n")
            except (OSError, ValueError):   # the line still goes out, if after a bar
                pass
        try:
            yield
        finally:
            _ended[id(file)] = _state(bars)
        return
    mode = None
    try:
        mode = bar_class.external_write_mode(file=file)
        mode.__enter__()
    except Exception:   # the lines still go out, if after a bar
        mode = None
    try:
        yield
    finally:
        if mode is not None:
            try:
                mode.__exit__(None, None, None)
            except Exception:   # a bar that cannot be redrawn stays cleared
                pass
