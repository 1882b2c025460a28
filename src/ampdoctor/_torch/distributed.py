"""torch.distributed internals: DTensor's found-inf reduction and FSDP2's mixed-precision policy.

Neither is imported here: a process that never imported torch.distributed is never made to.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def dtensor_reduces_found_inf() -> bool:
    """Return whether DTensor all-reduces GradScaler's found-inf flags across ranks.

    DTensor's dispatcher has a ``found_inf_reduce_handler`` (torch 2.13 has it), so a plain GradScaler agrees
    across ranks under FSDP2. Without it (older torch, or DTensor not imported) the answer is False: each rank
    decides alone.
    """
    dispatch = sys.modules.get("torch.distributed.tensor._dispatch")
    return dispatch is not None and hasattr(dispatch, "found_inf_reduce_handler")


def fsdp2_param_dtype(module: Any) -> torch.dtype | None:
    """Return the ``param_dtype`` of an FSDP2 (``fully_shard``) module's ``MixedPrecisionPolicy``, None if unknown."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if not callable(get_state):
        return None
    try:
        state = get_state()
    except Exception:   # not initialised yet, or a torch that changed the state object
        return None
    dtype = getattr(getattr(state, "_mp_policy", None), "param_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None
