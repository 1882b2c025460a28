"""What frameworks do inside a training loop that the loop's own code does not say.

The autocast a framework enters inside a model's forward, where a forward pre-hook cannot see it yet: accelerate's
prepared ``forward`` and Fabric's ``_FabricModule.forward`` (``ampdoctor._compat.accelerate``,
``ampdoctor._compat.lightning``). In both, the root module's forward pre-hook runs before autocast starts, so
``torch.is_autocast_enabled()`` there says no. ``--fix`` must know, to pick an upcast (autocast computes in half)
over fp32 master weights (no autocast). Lightning's Trainer enters autocast around ``training_step``, before any
module runs, so it needs nothing here.

The ``load_state_dict`` that is not a resume: accelerate's placement reload (``is_placement_reload``, from
``ampdoctor._compat.accelerate``, where the frames it reads are described).

The losses a framework's log leaves out: the transformers Trainer that holds the run's Accelerator, with
``logging_nan_inf_filter=True`` (its default), logs the average of the earlier losses in place of a NaN/inf one
(``hidden_losses``), so the watch checks every loss for them (AMP610).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampdoctor._compat.accelerate import accelerator_autocast, is_placement_reload, prepared_forward
from ampdoctor._compat.lightning import fabric_autocast, is_fabric_module
from ampdoctor._compat.transformers import trainer_of

__all__ = ["framework_autocast", "autocast_ahead", "hidden_losses", "is_placement_reload"]


def framework_autocast(module: nn.Module, accelerator: Any = None) -> torch.dtype | None:
    """Return the autocast dtype a framework will enter inside ``module``'s forward, None if none.

    >>> framework_autocast(nn.Linear(2, 2)) is None
    True
    """
    if is_fabric_module(module):
        return fabric_autocast(module)
    if prepared_forward(module):
        return accelerator_autocast(accelerator)
    return None


def autocast_ahead(accelerator: Any, scalers: list[Any]) -> torch.dtype | None:
    """Return the autocast dtype the coming forwards will run under, known before any ran, or None.

    For a repair before ``DistributedDataParallel`` builds its buckets (``--fix``): an Accelerator whose
    ``prepare`` wraps ``forward`` in autocast (``native_amp`` with ``mixed_precision`` fp16/bf16), else an enabled
    GradScaler, which is there for fp16 autocast. Anything else is not known yet.

    >>> autocast_ahead(None, [torch.amp.GradScaler("cpu")])
    torch.float16
    """
    dtype = accelerator_autocast(accelerator)
    if dtype is not None:
        return dtype
    from ampdoctor._torch.scaler import is_enabled

    return torch.float16 if any(is_enabled(s) for s in scalers) else None


def hidden_losses(accelerator: Any) -> str | None:
    """Return what keeps inf/NaN training losses out of the run's logged loss, as the finding names it, or None.

    The transformers Trainer that holds ``accelerator`` (it built it), with ``logging_nan_inf_filter=True``.

    >>> hidden_losses(None) is None
    True
    """
    args = getattr(trainer_of(accelerator), "args", None)
    if not getattr(args, "logging_nan_inf_filter", False):
        return None
    return "TrainingArguments(logging_nan_inf_filter=True)"
