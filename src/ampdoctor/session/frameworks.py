"""What frameworks do inside a training loop that the loop's own code does not say.

The autocast a framework enters inside a model's forward, where a forward pre-hook cannot see it yet. accelerate
(`prepare`) replaces ``model.forward`` with one that enters ``torch.autocast`` and keeps the original in
``model._original_forward``; Fabric's ``_FabricModule.forward`` enters its precision plugin's ``forward_context()``.
In both, the root module's forward pre-hook runs before autocast starts, so ``torch.is_autocast_enabled()`` there
says no. ``--fix`` must know, to pick an upcast (autocast computes in half) over fp32 master weights (no autocast).
Lightning's Trainer enters autocast around ``training_step``, before any module runs, so it needs nothing here.

The ``load_state_dict`` that is not a resume. accelerate's ``AcceleratedOptimizer.__init__`` (read in accelerate
1.15, ``optimizer.py``) moves the optimizer to the device by reloading its own ``state_dict()``: with
``device_placement=True``, the default, every ``accelerator.prepare(optimizer)`` calls ``load_state_dict``.
Nothing is restored, so it must not count as a resume without the GradScaler's state (AMP410).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

_ACCELERATE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def framework_autocast(module: nn.Module, accelerator: Any = None) -> torch.dtype | None:
    """Return the autocast dtype a framework will enter inside ``module``'s forward, None if none.

    >>> framework_autocast(nn.Linear(2, 2)) is None
    True
    """
    if type(module).__name__ == "_FabricModule":
        plugin = getattr(getattr(module, "_strategy", None), "precision", None)
        if type(plugin).__name__ == "MixedPrecision":   # "16-mixed" / "bf16-mixed"; "16-true" is HalfPrecision
            return torch.bfloat16 if getattr(plugin, "precision", "") == "bf16-mixed" else torch.float16
        return None
    if hasattr(module, "_original_forward") and accelerator is not None and getattr(accelerator, "native_amp", False):
        return _ACCELERATE.get(str(getattr(accelerator, "mixed_precision", "no")))
    return None


def autocast_ahead(accelerator: Any, scalers: list[Any]) -> torch.dtype | None:
    """Return the autocast dtype the coming forwards will run under, known before any ran, or None.

    For a repair before ``DistributedDataParallel`` builds its buckets (``--fix``): an Accelerator whose
    ``prepare`` wraps ``forward`` in autocast (``native_amp`` with ``mixed_precision`` fp16/bf16), else an enabled
    GradScaler, which is there for fp16 autocast. Anything else is not known yet.

    >>> autocast_ahead(None, [torch.amp.GradScaler("cpu")])
    torch.float16
    """
    if accelerator is not None and getattr(accelerator, "native_amp", False):
        dtype = _ACCELERATE.get(str(getattr(accelerator, "mixed_precision", "no")))
        if dtype is not None:
            return dtype
    from ampdoctor._torch.scaler import is_enabled

    return torch.float16 if any(is_enabled(s) for s in scalers) else None


def is_placement_reload(optimizer: Any, depth: int = 12) -> bool:
    """Return whether the running ``optimizer.load_state_dict`` is accelerate moving it to its device.

    Called from inside the load (an observer of ``Optimizer.load_state_dict``): looks up the calling frames for
    ``AcceleratedOptimizer.__init__`` wrapping this very optimizer. False when accelerate is not imported.

    >>> is_placement_reload(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
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
