"""The autocast a framework enters inside a model's forward, where a forward pre-hook cannot see it yet.

accelerate (`prepare`) replaces ``model.forward`` with one that enters ``torch.autocast`` and keeps the original in
``model._original_forward``; Fabric's ``_FabricModule.forward`` enters its precision plugin's ``forward_context()``.
In both, the root module's forward pre-hook runs before autocast starts, so ``torch.is_autocast_enabled()`` there
says no. ``--fix`` must know, to pick an upcast (autocast computes in half) over fp32 master weights (no autocast).
Lightning's Trainer enters autocast around ``training_step``, before any module runs, so it needs nothing here.
"""

from __future__ import annotations

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
