"""torch's own owners of parameters and precision: FSDP2's mixed-precision policy and mesh, and DDP's wrappers.

Nothing is imported here. FSDP2's policy and mesh are read through ``_get_fsdp_state()`` (torch 2.13; without it the
answer is None, "unknown"). DDP wrappers are found in a garbage-collector scan that runs only while a process group
is initialised (DDP cannot be built without one). The engines of other libraries (DeepSpeed, Megatron-LM, apex)
are recognised in ``ampdoctor._compat.engines``, which uses the same scan.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, Callable, Iterable

import torch
from torch import nn


def fsdp2_policy(module: Any) -> tuple[torch.dtype | None, torch.dtype | None] | None:
    """Return ``(param_dtype, reduce_dtype)`` of an FSDP2 module's ``MixedPrecisionPolicy``, None if unknown."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if not callable(get_state):
        return None
    try:
        policy = getattr(get_state(), "_mp_policy", None)
    except Exception:   # not initialised yet, or a torch that changed the state object
        return None
    if policy is None:
        return None
    param, reduce = getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None)
    return (param if isinstance(param, torch.dtype) else None, reduce if isinstance(reduce, torch.dtype) else None)


def fsdp2_reduce_size(module: Any) -> int | None:
    """Return how many ranks an FSDP2 module's gradient reduction spans (shard × replicate), None if unknown."""
    try:
        groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or []
        info = groups[0].mesh_info
    except Exception:   # no parameters, not initialised, or another torch
        return None
    size = 1
    for attr in ("shard_mesh_size", "replicate_mesh_size"):
        value = getattr(info, attr, None)
        if isinstance(value, int):
            size *= value
    return size


def live_objects(keep: Callable[[Any], bool]) -> list[Any]:
    """Return the objects the garbage collector tracks for which ``keep(obj)`` is true (after a collection).

    >>> model = nn.Linear(2, 2)
    >>> any(o is model for o in live_objects(lambda o: isinstance(o, nn.Linear)))
    True
    """
    gc.collect()
    with warnings.catch_warnings():   # isinstance() on deprecated proxies warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if keep(o)]


def ddp_wrappers(params: Iterable[torch.Tensor]) -> list[nn.Module]:
    """Return the live ``DistributedDataParallel`` modules that hold any of ``params``.

    DDP's reducer buckets were built for the parameters' dtypes when it was constructed, so nothing may change
    their dtype or swap their ``.data``/``.grad`` afterwards. Only scans while a process group is initialised (DDP
    cannot be built without one).
    """
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    ids = {id(p) for p in params}
    if not ids:
        return []
    ddp = torch.nn.parallel.DistributedDataParallel
    # a DDP still in its __init__ (ampdoctor's --fix runs just before it) has no .module and no buckets yet
    return [m for m in live_objects(lambda o: isinstance(o, ddp))
            if isinstance(getattr(m, "module", None), nn.Module) and any(id(p) in ids for p in m.module.parameters())]
