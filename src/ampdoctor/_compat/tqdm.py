"""tqdm internals: whether a progress bar is open, so that ampdoctor's lines start at column 0 and not after a bar.

A tqdm bar redraws its line with ``'\\r'`` and writes no ``'\\n'`` until it closes; piped into a log file the bar's
last state is still on the current line, so a line written there reads ``...it/s]ampdoctor --fix: ...`` and
``grep '^ampdoctor'`` misses it. tqdm's own answer is ``tqdm.external_write_mode`` (what ``tqdm.write`` uses): it
clears the open bars (``'\\r'``, spaces, ``'\\r'``), lets the caller write whole lines, then redraws the bars under
them. Which bars are open is tqdm's private ``tqdm._instances`` (a WeakSet of the bars not yet closed, disabled
ones left out). Without tqdm imported, or a tqdm without ``_instances``/``external_write_mode``, nothing is cleared
and the lines are written as they are. Tested with tqdm 4.70.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["clear_of_bars"]


def _open_bars() -> Any:
    """Return the tqdm class when a tqdm bar is open, else None (tqdm not imported: no bar can be)."""
    bar_class = getattr(sys.modules.get("tqdm"), "tqdm", None)
    instances = getattr(bar_class, "_instances", None)
    if not instances or not callable(getattr(bar_class, "external_write_mode", None)):
        return None
    try:
        shown = [bar for bar in list(instances) if not getattr(bar, "disable", False)]
    except (TypeError, RuntimeError):   # not a set, or changed by another thread while read
        return None
    return bar_class if shown else None


@contextmanager
def clear_of_bars(file: Any) -> Iterator[None]:
    """Clear the open tqdm bars while the caller writes whole lines to ``file``, and redraw them after.

    With no bar open this does nothing. A failure of tqdm's own (a closed stream) never reaches the caller: the
    lines are then written as they are.

    >>> import io
    >>> out = io.StringIO()
    >>> with clear_of_bars(out):
    ...     _ = out.write("ampdoctor: a line\\n")
    >>> out.getvalue()
    'ampdoctor: a line\\n'
    """
    bar_class = _open_bars()
    mode = None
    if bar_class is not None:
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
