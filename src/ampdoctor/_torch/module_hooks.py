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

import torch

COMPILE_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def any_global_module_hook() -> bool:
    """Return whether a global module hook (forward, pre-forward, backward) is registered.

    >>> any_global_module_hook()
    False
    """
    probe = getattr(torch.nn.modules.module, "_has_any_global_hook", None)
    return bool(probe()) if callable(probe) else False


def silence_compile_hook_warning() -> None:
    """Ignore torch.compile's global-hook warning from now on (call before registering ampdoctor's own)."""
    warnings.filterwarnings("ignore", message=COMPILE_HOOK_WARNING, category=UserWarning)
