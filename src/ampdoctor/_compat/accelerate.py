"""accelerate internals: whether an Accelerator exists, its autocast, its prepared forward and its placement reload.

Nothing imports accelerate: each probe looks in ``sys.modules`` (or at the object it is given), and answers "no"
when accelerate is not loaded.

The autocast accelerate enters inside a model's forward, where a forward pre-hook cannot see it yet: ``prepare``
replaces ``model.forward`` with one that enters ``torch.autocast`` and keeps the original in
``model._original_forward`` (``native_amp`` with ``mixed_precision`` ``"fp16"``/``"bf16"``). Without that attribute
the model reads as not prepared, and ``--fix`` picks its repair from what it sees at the first forward.

The ``load_state_dict`` that is not a resume. ``AcceleratedOptimizer.__init__`` (accelerate 1.15, ``optimizer.py``)
moves the optimizer to the device by reloading its own ``state_dict()``: with ``device_placement=True``, the default,
every ``accelerator.prepare(optimizer)`` calls ``load_state_dict``. Nothing is restored, so it must not count as a
resume without the GradScaler's state (AMP410). Told from the calling frames: the one running that ``__init__`` holds
the optimizer in its local ``optimizer``. Without the class or its code the answer is "not a reload".

Whether an Accelerator was built: ``AcceleratorState._shared_state`` (the state all its instances share) is empty
until one is. Without the attribute the answer is "none", and the caller looks for no Accelerator object.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

_AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def accelerator_built() -> bool:
    """Return whether an ``accelerate.Accelerator`` was constructed in this process (False when accelerate is not
    imported)."""
    state = getattr(sys.modules.get("accelerate.state"), "AcceleratorState", None)
    return bool(getattr(state, "_shared_state", None))


def accelerator_autocast(accelerator: Any) -> torch.dtype | None:
    """Return the dtype of the ``torch.autocast`` an Accelerator's prepared forwards run under, None if none.

    >>> accelerator_autocast(None) is None
    True
    """
    if accelerator is None or not getattr(accelerator, "native_amp", False):
        return None
    return _AUTOCAST.get(str(getattr(accelerator, "mixed_precision", "no")))


def prepared_forward(module: Any) -> bool:
    """Return whether ``accelerator.prepare`` replaced ``module.forward`` (it keeps the original beside it).

    >>> import torch
    >>> prepared_forward(torch.nn.Linear(2, 2))
    False
    """
    return hasattr(module, "_original_forward")


def is_placement_reload(optimizer: Any, depth: int = 12) -> bool:
    """Return whether the running ``optimizer.load_state_dict`` is accelerate moving it to its device.

    Called from inside the load (an observer of ``Optimizer.load_state_dict``): looks up the calling frames for
    ``AcceleratedOptimizer.__init__`` wrapping this very optimizer. False when accelerate is not imported.

    >>> import torch
    >>> is_placement_reload(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    False
    """
    cls = getattr(sys.modules.get("accelerate.optimizer"), "AcceleratedOptimizer", None)
    code = getattr(getattr(cls, "__init__", None), "__code__", None)
    if code is None:
        return False
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is code:
            return frame.f_locals.get("optimizer") is optimizer
        frame = frame.f_back
    return False
