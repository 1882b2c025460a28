"""Global module hooks: whether any is registered, and torch.compile's warning about ours.

``torch.compile(module)`` returns an ``OptimizedModule`` that warns on every first call while *any* global module
hook exists ("Using `torch.compile(module)` when there are global hooks on modules ..."): the hooks fire once more,
for the wrapper. ``ampdoctor run`` registers two global forward hooks to find the model, so every compiled script
would print that warning because of ampdoctor. Its hooks expect the extra call (the wrapper is unwrapped to the
module it compiles), so the warning is silenced, but only when no global hook existed before ampdoctor's: a hook of
the user's keeps its warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def any_global_module_hook() -> bool:
    """Return whether a global module hook (forward, pre-forward, backward) is registered.

    >>> any_global_module_hook()
    False
    """
    probe = getattr(torch.nn.modules.module, "_has_any_global_hook", None)
    return bool(probe()) if callable(probe) else False


def remove_global_hook(handle: Any) -> None:
    """Remove a global module hook's handle, and its entry in ``_global_forward_hooks_with_kwargs``: torch 2.13's
    handle of a ``with_kwargs=True`` global forward hook leaves it there (and ``_has_any_global_hook`` true)."""
    hook_id = getattr(handle, "id", None)
    handle.remove()
    with_kwargs = getattr(torch.nn.modules.module, "_global_forward_hooks_with_kwargs", None)
    if isinstance(with_kwargs, dict):
        with_kwargs.pop(hook_id, None)


class SilencedWarning:
    """A warnings filter that ``remove()`` takes out again, like a hook's ``RemovableHandle``.

    Only its own entry is removed (the script may have added filters since), and the filters' version is bumped as
    ``warnings.filterwarnings`` does, so no location keeps the "ignored" it cached meanwhile.
    """

    def __init__(self, message: str, category: type[Warning]) -> None:
        warnings.filterwarnings("ignore", message=message, category=category)
        self._entry: tuple | None = warnings.filters[0]

    def remove(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None and entry in warnings.filters:
            warnings.filters.remove(entry)
            mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held",
                                                                              None)
            if callable(mutated):
                mutated()


def silence_compile_hook_warning() -> SilencedWarning:
    """Ignore torch.compile's global-hook warning until the returned handle is removed (register it with
    ampdoctor's own global hooks, and remove it with them).

    >>> import warnings
    >>> before = list(warnings.filters)
    >>> handle = silence_compile_hook_warning()
    >>> handle.remove()
    >>> warnings.filters == before
    True
    """
    return SilencedWarning(COMPILE_HOOK_WARNING, UserWarning)
