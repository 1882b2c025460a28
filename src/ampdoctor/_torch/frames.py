"""Frame internals: the local variables of torch's frames and of the user's, read from a traceback or a generator.

``clip_grad_norm_(model.parameters(), ...)`` passes a generator; consuming it would take it from torch. The module
is read from the suspended generator's frame locals (``self`` in ``Module.parameters``, ``.0`` for a nested
generator expression). A crash is explained from the frames of its traceback: the ``self`` of each method frame
(the GradScaler, the modules whose forward ran), what torch's own functions held (``GradScaler._unscale_grads_``'s
``optimizer`` and loop variable ``param``, ``clip_grad_norm_``'s ``parameters`` list, the ``autocast_instance`` of
torch's autocast decorator, torch 2.13 names), and every local of the user's frames (the model, the optimizer).

A Python that hides frame locals (or a frame whose locals cannot be read) gives None or nothing: the caller names
no module, no parameter, no autocast, and builds its setup from what it has.
"""

from __future__ import annotations

from types import FrameType, GeneratorType
from typing import Any

import torch
from torch import nn


def _locals(frame: FrameType) -> Any:
    try:
        return frame.f_locals
    except Exception:   # a frame being torn down, or an interpreter without the mapping
        return {}


def generator_module(gen: Any, depth: int = 3) -> nn.Module | None:
    """Return the ``nn.Module`` a parameter generator iterates over, without advancing it.

    >>> generator_module(nn.Linear(2, 2).parameters()).__class__.__name__
    'Linear'
    """
    if not isinstance(gen, GeneratorType) or depth == 0:
        return None
    frame = gen.gi_frame
    if frame is None:
        return None
    f_locals = _locals(frame)
    owner = f_locals.get("self")
    if isinstance(owner, nn.Module):
        return owner
    return generator_module(f_locals.get(".0"), depth - 1)


def frame_self(frame: FrameType) -> Any:
    """Return the ``self`` of a method's frame, None for a frame without one."""
    return _locals(frame).get("self")


def scaler_frame_tensors(frame: FrameType) -> tuple[torch.optim.Optimizer | None, torch.Tensor | None]:
    """Return, for a frame of a ``GradScaler`` method, the ``optimizer`` it was called with and the parameter its
    ``_unscale_grads_`` loop was at (``param``); None for what the frame does not hold."""
    f_locals = _locals(frame)
    optimizer, param = f_locals.get("optimizer"), f_locals.get("param")
    return (optimizer if isinstance(optimizer, torch.optim.Optimizer) else None,
            param if isinstance(param, torch.Tensor) else None)


def clip_parameters(frame: FrameType) -> list[Any] | None:
    """Return the ``parameters`` list of a ``clip_grad_norm_`` frame (torch makes it a list first), else None."""
    if frame.f_code.co_name != "clip_grad_norm_":
        return None
    parameters = _locals(frame).get("parameters")
    return parameters if isinstance(parameters, list) else None


def autocast_decorator(frame: FrameType) -> torch.autocast | None:
    """Return the ``torch.autocast`` of a frame of torch's autocast decorator (``decorate_autocast``), else None
    (accelerate wraps a prepared ``forward`` with one)."""
    if frame.f_code.co_name != "decorate_autocast":
        return None
    instance = _locals(frame).get("autocast_instance")
    return instance if isinstance(instance, torch.autocast) else None


def frame_values(frame: FrameType) -> list[tuple[str, Any]]:
    """Return every local variable of ``frame`` as ``(name, value)``, a list taken now (the frame may run on).

    >>> import sys
    >>> answer = 42
    >>> ("answer", 42) in frame_values(sys._getframe())
    True
    """
    return list(_locals(frame).items())
