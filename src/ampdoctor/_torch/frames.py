"""Frame internals: the module behind a not-yet-consumed ``model.parameters()`` generator.

``clip_grad_norm_(model.parameters(), ...)`` passes a generator; consuming it would take it from torch. The module
is read from the suspended generator's frame locals (``self`` in ``Module.parameters``, ``.0`` for a nested
generator expression). A Python that hides them gives None, and the caller names no module.
"""

from __future__ import annotations

from types import GeneratorType
from typing import Any

from torch import nn


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
    f_locals = frame.f_locals
    owner = f_locals.get("self")
    if isinstance(owner, nn.Module):
        return owner
    return generator_module(f_locals.get(".0"), depth - 1)
