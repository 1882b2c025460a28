"""Tell whether a crash happened inside ``torch.autocast``, from its traceback alone.

By the time an exception is explained, its ``with torch.autocast(...)`` block has exited, so the autocast state is
gone. What stays is where each frame of the traceback was: a frame whose line sits in the body of a ``with
...autocast(...)`` block (or of a function decorated with one) ran under it, and a frame of torch's own autocast
decorator (accelerate wraps ``forward`` with one) holds the autocast object. Sources are parsed once per file.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
from types import TracebackType

from ampdoctor._torch.frames import autocast_decorator
from ampdoctor.core.callsite import is_own_file

_MAX_SOURCE_LINES = 50_000   # a larger file is not parsed: the answer is "not seen", never a guess
_MAX_FRAMES = 400


def autocast_scope(tb: TracebackType | None) -> str | None:
    """Return where a traceback's innermost autocast region was entered, e.g.
    ``"inside torch.autocast('cpu', dtype=torch.bfloat16) at train.py:12"``, or None when no frame shows one.

    None means none was seen, not that there was none (autocast entered by hand with ``__enter__`` is invisible).
    """
    found = None
    for _ in range(_MAX_FRAMES):
        if tb is None:
            break
        frame, line = tb.tb_frame, tb.tb_lineno
        filename = frame.f_code.co_filename
        instance = autocast_decorator(frame)
        if instance is not None:
            dtype = str(instance.fast_dtype).replace("torch.", "")
            found = f"inside a torch.autocast({instance.device!r}, dtype=torch.{dtype}) decorator on the forward"
        elif not is_own_file(filename):
            block = _enclosing(filename, line)
            if block is not None:
                found = f"inside {block[1]} at {os.path.basename(filename)}:{block[0]}"
        tb = tb.tb_next
    return found


def _enclosing(filename: str, line: int) -> tuple[int, str] | None:
    """Return (header line, source) of the innermost autocast block whose body holds ``line``."""
    lines = linecache.getlines(filename)
    if not lines or len(lines) > _MAX_SOURCE_LINES:
        return None
    inner = None
    for start, end, header, text in _autocast_blocks(filename, len(lines), hash("".join(lines))):
        if start <= line <= end and (inner is None or start >= inner[0]):
            inner = (start, header, text)
    return (inner[1], inner[2]) if inner else None


@functools.lru_cache(maxsize=64)
def _autocast_blocks(filename: str, n_lines: int, digest: int) -> tuple[tuple[int, int, int, str], ...]:
    """Return (first body line, last line, header line, call source) of every autocast block in a file."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError, RecursionError):
        return ()
    blocks = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            calls = [item.context_expr for item in node.items]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            calls = node.decorator_list
        else:
            continue
        for call in calls:
            text = _autocast_call(call)
            if text is not None and node.body:
                blocks.append((node.body[0].lineno, node.end_lineno or node.body[-1].lineno, node.lineno, text))
    return tuple(blocks)


def _autocast_call(expr: ast.expr) -> str | None:
    """Return the source of ``torch.autocast(...)``-like calls (any callee named ``autocast``) unless disabled."""
    if not isinstance(expr, ast.Call):
        return None
    func = expr.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name != "autocast":
        return None
    for keyword in expr.keywords:   # enabled=False is no autocast; enabled=<a variable> is not known here
        if keyword.arg == "enabled" and not (isinstance(keyword.value, ast.Constant) and keyword.value.value):
            return None
    return ast.unparse(expr)[:120]
