"""Pass-through observers set on a framework object for one run, for what its callback events do not show.

The transformers Trainer has no exception event, and Lightning calls no ``on_exception`` in the worker processes
that ``strategy="ddp_spawn"`` starts (the launcher runs the fit there without its error handling): an instance
attribute set over the method that runs the training sees the exception, lets ampdoctor explain it, and re-raises it
unchanged. ``remove()`` puts back exactly what was there.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Observer", "on_exception"]


def on_exception(owner: Any, name: str, callback: Callable[[BaseException], None]) -> "Observer":
    """Observe ``owner.name`` for exceptions: ``callback(exc)`` runs, then the exception propagates unchanged."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except BaseException as exc:
            try:
                callback(exc)
            except Exception:
                pass   # ampdoctor's own failure must not replace the user's exception
            raise

    return Observer(owner, name, wrapper)


class Observer:
    """An instance attribute set over a method; ``remove()`` puts back exactly what was there."""

    def __init__(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self.owner, self.name, self.wrapper = owner, name, wrapper
        self.had, self.previous = name in vars(owner), vars(owner).get(name)
        setattr(owner, name, wrapper)

    def remove(self) -> None:
        if vars(self.owner).get(self.name) is not self.wrapper:
            return   # someone set it again since: theirs stays
        if self.had:
            setattr(self.owner, self.name, self.previous)
        else:
            delattr(self.owner, self.name)
