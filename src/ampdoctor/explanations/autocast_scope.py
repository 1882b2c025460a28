"""Tell whether a crash happened inside ``torch.autocast``, from its traceback alone.

By the time an exception is explained, its ``with torch.autocast(...)`` block has exited, so the autocast state is
gone. What stays is where each frame of the traceback was: a frame whose line sits in the body of a ``with
...autocast(...)`` block (or of a function decorated with one) ran under it, and a frame of torch's own autocast
decorator (accelerate wraps ``forward`` with one) holds the autocast object. A ``with NAME:`` block counts when
``NAME`` was assigned an autocast call in the same function (diffusers' ``autocast_ctx = torch.autocast(...)``, or
``nullcontext()`` on another branch): the frame's own ``NAME`` then says which one ran. Sources are parsed once per
file.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import linecache
import os
from types import FrameType, TracebackType
from typing import Iterator

from ampdoctor._torch.frames import autocast_decorator, frame_values
from ampdoctor.core.callsite import is_own_file

_MAX_SOURCE_LINES = 50_000   # a larger file is not parsed: the answer is "not seen", never a guess
_MAX_FRAMES = 400
_Block = tuple[int, int, int, str, "str | None"]   # first body line, last line, header line, call source, variable


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
            block = _enclosing(filename, line, frame)
            if block is not None:
                found = f"inside {block[1]} at {os.path.basename(filename)}:{block[0]}"
        tb = tb.tb_next
    return found


def _enclosing(filename: str, line: int, frame: FrameType | None = None) -> tuple[int, str] | None:
    """Return (header line, source) of the innermost autocast block whose body holds ``line``.

    A ``with NAME:`` block is skipped when ``frame`` binds ``NAME`` to a ``nullcontext()`` (that branch ran).
    """
    lines = linecache.getlines(filename)
    if not lines or len(lines) > _MAX_SOURCE_LINES:
        return None
    inner = None
    for start, end, header, text, name in _autocast_blocks(filename, len(lines), hash("".join(lines))):
        if start <= line <= end and (inner is None or start >= inner[0]) and _bound_to_autocast(frame, name):
            inner = (start, header, text)
    return (inner[1], inner[2]) if inner else None


def _bound_to_autocast(frame: FrameType | None, name: str | None) -> bool:
    """Return whether the context variable ``name`` may hold an autocast in ``frame``: anything but a
    ``nullcontext()`` (``accelerator.autocast()`` is a generator context manager, not a ``torch.autocast``)."""
    if name is None or frame is None:
        return True
    value = dict(frame_values(frame)).get(name)   # a frame whose locals cannot be read: the source alone decides
    return not isinstance(value, contextlib.nullcontext)


@functools.lru_cache(maxsize=64)
def _autocast_blocks(filename: str, n_lines: int, digest: int) -> tuple[_Block, ...]:
    """Return (first body line, last line, header line, call source, context variable or None) of every autocast
    block in a file."""
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError, RecursionError):
        return ()
    blocks: list[_Block] = []
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            blocks += _scope_blocks(scope)
    return tuple(blocks)


def _scope_blocks(scope: ast.AST) -> list[_Block]:
    """Return the autocast blocks of one function (or module) body, nested functions left to their own scope."""
    nodes = list(_own_nodes(scope))
    variables: dict[str, str] = {}   # a name assigned an autocast call here -> the call's source
    for node in nodes:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            text = _assigned_autocast(node.value)
            for target in targets:
                if text is not None and isinstance(target, ast.Name):
                    variables.setdefault(target.id, text)
    blocks: list[_Block] = []
    for node in nodes:
        if isinstance(node, (ast.With, ast.AsyncWith)):
            exprs = [item.context_expr for item in node.items]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            exprs = node.decorator_list
        else:
            continue
        for expr in exprs:
            name = expr.id if isinstance(expr, ast.Name) and expr.id in variables else None
            text = f"{variables[name]} (as {name})" if name is not None else _autocast_call(expr)
            if text is not None and node.body:
                blocks.append((node.body[0].lineno, node.end_lineno or node.body[-1].lineno, node.lineno, text, name))
    return blocks


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """Yield the nodes of ``scope``'s body, and the headers (not the bodies) of the functions defined in it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(ast.iter_child_nodes(node))


def _assigned_autocast(value: ast.expr) -> str | None:
    """Return the autocast call source of an assigned value, either branch of ``a if cond else b`` included."""
    if isinstance(value, ast.IfExp):
        return _assigned_autocast(value.body) or _assigned_autocast(value.orelse)
    return _autocast_call(value)


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
