"""Lightning internals: Fabric's module wrapper and its autocast, and the worker processes of ``ddp_spawn``.

Nothing imports Lightning: the classes are recognised by name or found in ``sys.modules``, for ``lightning`` and
``pytorch_lightning`` alike.

``fabric.setup(model)`` returns a ``_FabricModule`` that delegates to the user's module (``_forward_module``) and
enters its precision plugin's ``forward_context()`` inside ``forward``: with ``MixedPrecision`` (``"16-mixed"``,
``"bf16-mixed"``; ``"16-true"`` is ``HalfPrecision``) that is ``torch.autocast``, which a forward pre-hook on the
root module cannot see yet. The plugin is read from ``_strategy.precision``; without those attributes the module
reads as no autocast, and the wrapper as not delegating (names keep its prefix).

``strategy="ddp_spawn"`` (``ddp_fork``, ``ddp_notebook``, XLA) runs the fit in workers that a
``_MultiProcessingLauncher`` started, without Lightning's error handling, so no callback's ``on_exception`` is
called there; ``Trainer._run_stage`` runs the fit in them. Without the launcher class the trainer reads as not a
spawned worker, and without ``_run_stage`` there is no method to observe: the worker's crash goes unexplained.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

_LAUNCHERS = ("lightning.pytorch.strategies.launchers.multiprocessing",
              "pytorch_lightning.strategies.launchers.multiprocessing")


def is_fabric_module(module: Any) -> bool:
    """Return whether ``module`` is Fabric's ``_FabricModule`` wrapper.

    >>> is_fabric_module(nn.Linear(2, 2))
    False
    """
    return type(module).__name__ == "_FabricModule"


def fabric_module_of(module: Any) -> nn.Module | None:
    """Return the user's module inside a ``_FabricModule``, None for any other module."""
    inner = getattr(module, "_forward_module", None) if is_fabric_module(module) else None
    return inner if isinstance(inner, nn.Module) else None


def fabric_autocast(module: Any) -> torch.dtype | None:
    """Return the autocast dtype a ``_FabricModule`` enters in its forward, None for none (or another module).

    >>> fabric_autocast(nn.Linear(2, 2)) is None
    True
    """
    if not is_fabric_module(module):
        return None
    plugin = getattr(getattr(module, "_strategy", None), "precision", None)
    if type(plugin).__name__ == "MixedPrecision":   # "16-mixed" / "bf16-mixed"; "16-true" is HalfPrecision
        return torch.bfloat16 if getattr(plugin, "precision", "") == "bf16-mixed" else torch.float16
    return None


def spawned_worker(trainer: Any) -> bool:
    """Return whether ``trainer`` runs in a worker that ``ddp_spawn``'s launcher started.

    >>> spawned_worker(object())
    False
    """
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    classes = tuple(c for c in (getattr(sys.modules.get(m), "_MultiProcessingLauncher", None) for m in _LAUNCHERS)
                    if isinstance(c, type))
    return bool(classes) and isinstance(launcher, classes)


def stage_method(trainer: Any) -> str | None:
    """Return the name of the Trainer method that runs the fit in a spawned worker, None when it has none.

    >>> stage_method(object()) is None
    True
    """
    return "_run_stage" if callable(getattr(trainer, "_run_stage", None)) else None


def precision_of(owner: Any) -> str | None:
    """Return the precision a Lightning ``Trainer`` or ``Fabric`` set up (``"bf16-mixed"``), or None: the Trainer's
    public ``precision``, the Fabric strategy's precision plugin's ``precision``."""
    value = getattr(owner, "precision", None) if not callable(getattr(owner, "precision", None)) else None
    if value is None:
        plugin = getattr(getattr(owner, "strategy", None), "precision", None)
        value = getattr(plugin, "precision", None)
    return value if isinstance(value, str) else None
