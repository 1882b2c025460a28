"""Pass-through observers on methods that offer no hook (GradScaler, clip_grad_norm_), removable exactly.

An observer calls the original and never changes arguments or results. Removing it restores the attribute as it
was: an instance attribute is deleted again (so the class method shows through), a module attribute is reset to
the very same object.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable

from ampdoctor.core.isolation import call_safely

_MISSING = object()


class PatchHandle:
    """A handle that removes one observer; like ``torch.utils.hooks.RemovableHandle``.

    >>> import types
    >>> ns = types.SimpleNamespace(f=lambda x: x + 1)
    >>> seen = []
    >>> h = observe(ns, "f", before=lambda *a, **k: seen.append(a))
    >>> ns.f(1), seen
    (2, [(1,)])
    >>> h.remove(); ns.f(1), len(seen)
    (2, 1)
    """

    def __init__(self, owner: Any, name: str, previous: Any, installed: Any) -> None:
        self.owner, self.name, self.previous, self.installed = owner, name, previous, installed
        self.removed = False

    def remove(self) -> None:
        if self.removed:
            return
        self.removed = True
        current = self.owner.__dict__.get(self.name, _MISSING) if hasattr(self.owner, "__dict__") else _MISSING
        if current is not self.installed:
            # Someone patched over us; unwrap only our layer by making it a plain pass-through.
            self.installed.__ampdoctor_disabled__ = True
            return
        if self.previous is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.previous)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def observe(
    owner: Any,
    name: str,
    before: Callable[..., Any] | None = None,
    after: Callable[..., Any] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    finally_: Callable[[], Any] | None = None,
    raised: Callable[..., Any] | None = None,
) -> PatchHandle:
    """Wrap ``owner.name`` so that ``before(*args, **kwargs)`` and ``after(result, *args, **kwargs)`` see each call.

    ``raised(exc, *args, **kwargs)`` sees a call that raised ``exc`` (a library that says "skip this step" by raising,
    as fairseq's loss scaler does), then ``finally_()`` runs after every call, also one that raised. Observer
    exceptions are passed to ``on_error`` and never reach the caller; the original's exceptions propagate unchanged.
    """
    original = getattr(owner, name)
    previous = owner.__dict__.get(name, _MISSING)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True   # IPython leaves this frame out: a cell's traceback reads as without ampdoctor
        if getattr(wrapper, "__ampdoctor_disabled__", False):
            return original(*args, **kwargs)
        if before is not None:
            call_safely(before, *args, on_error=on_error, **kwargs)
        shown, caller = warnings.showwarning, sys._getframe(1)
        warnings.showwarning = functools.partial(_relocated, shown, caller)
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            if raised is not None:
                call_safely(raised, exc, *args, on_error=on_error, **kwargs)
            raise
        finally:
            if isinstance(warnings.showwarning, functools.partial) and warnings.showwarning.func is _relocated:
                warnings.showwarning = shown
            if finally_ is not None:
                call_safely(finally_, on_error=on_error)
        if after is not None:
            call_safely(after, result, *args, on_error=on_error, **kwargs)
        return result

    wrapper.__ampdoctor_observer__ = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
    return PatchHandle(owner, name, previous, wrapper)


class ImportHandle(importlib.abc.MetaPathFinder):
    """Call ``then()`` right after the module ``name`` is imported (at once if it already is), and keep what it
    returns (handles with ``remove()``) to remove with this handle: observers of a class from an optional package,
    installed only if the script imports it.

    >>> import types
    >>> done = []
    >>> h = ImportHandle("ampdoctor", lambda: done.append(1) or [])   # imported already: at once
    >>> done
    [1]
    >>> h.remove()
    """

    def __init__(self, name: str, then: Callable[[], list[Any]],
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.name, self.then, self.on_error, self.fired = name, then, on_error, False
        self.handles: list[Any] = []
        if name in sys.modules:
            self._fire()
        else:
            sys.meta_path.insert(0, self)

    def _fire(self) -> None:
        self.fired = True
        self.handles += call_safely(self.then, on_error=self.on_error) or []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name or self.fired:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_observe(module: Any) -> None:
            exec_module(module)
            self._fire()

        spec.loader.exec_module = exec_then_observe  # type: ignore[method-assign]
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for handle in reversed(self.handles):
            handle.remove()
        self.handles = []


def _relocated(show: Callable[..., Any], caller: Any, message: Any, category: Any, filename: str, lineno: int,
               file: Any = None, line: Any = None) -> Any:
    """Show a warning where the script called the observed function, not in this file's wrapper.

    A warning raised with ``stacklevel=2`` inside the original (torch's "GradScaler is enabled, but CUDA is not
    available", "Detected call of `lr_scheduler.step()` before `optimizer.step()`") names its caller's line; with
    the wrapper in between it would name the wrapper. Only what is shown moves: the filters and the once-per-place
    registry see the warning as Python computed it.
    """
    if filename == __file__:
        filename, lineno, line = caller.f_code.co_filename, caller.f_lineno, None
    return show(message, category, filename, lineno, file, line)
