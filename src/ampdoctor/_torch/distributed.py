"""torch.distributed internals: DTensor's found-inf reduction, gradient layouts, FSDP1's flat parameters.

Neither is imported here: a process that never imported torch.distributed is never made to.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch


def dtensor_reduces_found_inf() -> bool:
    """Return whether DTensor all-reduces GradScaler's found-inf flags across ranks.

    DTensor's dispatcher has a ``found_inf_reduce_handler`` (torch 2.13 has it), so a plain GradScaler agrees
    across ranks under FSDP2. Without it (older torch, or DTensor not imported) the answer is False: each rank
    decides alone.
    """
    dispatch = sys.modules.get("torch.distributed.tensor._dispatch")
    return dispatch is not None and hasattr(dispatch, "found_inf_reduce_handler")


# ---- gradient layouts: which gradients are shards, and over which process groups --------------------------------
# A layout is ("local", ()) for a gradient that holds its whole value on this rank (plain tensor, DDP replica,
# replicated DTensor, FSDP1 NO_SHARD), ("sharded", groups) for one whose rows are split over each group's ranks
# (FSDP2 / TP ``Shard`` DTensors, sharded FSDP1 flat parameters), and ("partial", ()) for a DTensor that is a
# pending sum (``Partial``): its statistics are not a function of the parts' statistics, and ("unknown",
# (placements,)) for a DTensor with a placement this module does not know: merging it could count entries twice or
# miss some, so it is named instead.
Layout = tuple[str, tuple[Any, ...]]
LOCAL: Layout = ("local", ())


def distributed_world() -> int:
    """Return the world size of the default process group, 1 when none is initialised (or no torch.distributed)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return 1
        return int(dist.get_world_size())
    except Exception:  # a torch without c10d, or a group being torn down
        return 1


def process_rank() -> int | None:
    """Return this process's rank in the default group, None when no process group is initialised."""
    if distributed_world() == 1 and not _initialised():
        return None
    try:
        return int(sys.modules["torch.distributed"].get_rank())
    except Exception:
        return None


def _initialised() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def param_layout(param: Any, fsdp1: dict[int, Layout]) -> Layout:
    """Return the layout of ``param``'s gradient (see ``Layout``), read from the parameter, the same on every rank.

    Args:
        param: a parameter the optimizer steps.
        fsdp1: ``fsdp1_layouts(model)``: the layouts of FSDP1 flat parameters (and of their original parameters).
    """
    if id(param) in fsdp1:
        return fsdp1[id(param)]
    placements = getattr(param, "placements", None)
    mesh = getattr(param, "device_mesh", None)
    if placements is None or mesh is None:
        return LOCAL
    kinds = [placement_kind(p) for p in placements]
    if "partial" in kinds:
        return ("partial", ())
    if "unknown" in kinds:
        return ("unknown", (", ".join(str(p) for p in placements),))
    # every mesh dimension the tensor is split over, in mesh order: a 2-D (dp, tp) DTensor is merged over both
    groups = tuple(mesh.get_group(dim) for dim, kind in enumerate(kinds) if kind == "shard")
    return ("sharded", groups) if groups else LOCAL


def grad_layout(grad: Any) -> str:
    """Return ``"local"``, ``"sharded"``, ``"partial"`` or ``"unknown"`` for a gradient as it is (a DTensor's
    placements)."""
    placements = getattr(grad, "placements", None)
    if placements is None or getattr(grad, "to_local", None) is None:
        return "local"
    kinds = {placement_kind(p) for p in placements}
    for kind in ("partial", "unknown", "shard"):
        if kind in kinds:
            return "sharded" if kind == "shard" else kind
    return "local"


def placement_kind(placement: Any) -> str:
    """Return ``"shard"``, ``"replicate"``, ``"partial"`` or ``"unknown"`` for a DTensor placement.

    ``_StridedShard`` (what ``fully_shard`` puts on the dp dimension of a tensor-parallel weight split on the same
    dim) is a shard: each rank holds distinct entries, and the ranks of that mesh dimension hold all of them. In
    torch 2.13 it is no ``Shard`` subclass and its ``is_shard()`` is False, so a check on ``is_shard`` alone would
    merge such a gradient over the tp group only. Anything else unrecognised is ``"unknown"``, never merged.
    """
    if _is(placement, "is_partial"):
        return "partial"
    if _is(placement, "is_replicate"):
        return "replicate"
    if _is(placement, "is_shard") or (type(placement).__name__ == "_StridedShard"
                                      and isinstance(getattr(placement, "dim", None), int)):
        return "shard"
    return "unknown"


def _is(placement: Any, test: str) -> bool:
    check = getattr(placement, test, None)
    return bool(check()) if callable(check) else False


def fsdp1_layouts(model: Any) -> dict[int, Layout]:
    """Return ``{id(parameter): layout}`` for the flat parameters of every FSDP1 unit in ``model`` (and the original
    parameters they hold with ``use_orig_params=True``): sharded over the unit's ``process_group`` unless its
    strategy is ``NO_SHARD``. Empty when FSDP1 was never imported or the model has no unit."""
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    cls = getattr(fsdp, "FullyShardedDataParallel", None)
    out: dict[int, Layout] = {}
    if cls is None or not hasattr(model, "modules"):
        return out
    for module in model.modules():
        if not isinstance(module, cls):
            continue
        handle = getattr(module, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if flat is None:
            continue
        strategy = getattr(getattr(module, "sharding_strategy", None), "name", "")
        layout: Layout = LOCAL if strategy == "NO_SHARD" or module.world_size == 1 else \
            ("sharded", (module.process_group,))
        for p in [flat, *(getattr(flat, "_params", None) or [])]:
            out[id(p)] = layout
    return out


def is_flat_param(param: Any) -> bool:
    """Return whether ``param`` is an FSDP1 ``FlatParameter`` (its class is plain Parameter: the flag tells)."""
    return bool(getattr(param, "_is_flat_param", False))


def flat_param_padding(param: Any) -> int:
    """Return the zero entries FSDP1 appended to this rank's shard of a flat parameter, 0 for anything else."""
    if not is_flat_param(param):
        return 0
    return int(getattr(param, "_shard_numel_padded", 0) or 0)


def local_part(tensor: Any) -> Any:
    """Return the part of ``tensor`` held on this rank: a DTensor's local shard, else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    if callable(to_local) and getattr(tensor, "placements", None) is not None:
        return to_local()
    return tensor


def local_numel(param: Any) -> int:
    """Return the number of entries of ``param`` held on this rank: a DTensor's local shard, an FSDP1 flat
    parameter's shard without padding, or the whole tensor."""
    to_local = getattr(param, "to_local", None)
    if callable(to_local) and getattr(param, "placements", None) is not None:
        return int(to_local().numel())
    return int(param.numel()) - flat_param_padding(param)


def reduction_device(group: Any) -> Any:
    """Return the device a collective on ``group`` takes its tensors on: CPU for gloo, the current CUDA device for
    NCCL (and the backend's device type for others, CPU when unknown)."""
    dist = sys.modules["torch.distributed"]
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or backend in ("", "undefined"):
        return torch.device("cpu")
    for device_type in ("xpu", "hpu", "mtia"):
        if device_type in backend or {"xccl": "xpu", "hccl": "hpu"}.get(backend) == device_type:
            return torch.device(device_type)
    return torch.device("cpu")


def runs_collectives(model: Any, engine: Callable[[Any], Any] = lambda module: False) -> bool:
    """Return whether calling ``model`` again on this rank alone could enter a collective the other ranks do not
    join: a process group of two or more ranks is initialised and the model is (or holds) a DDP, FSDP1 or FSDP2
    module or a module for which ``engine(module)`` is true (``ampdoctor._compat.engines.engine_family``:
    DeepSpeed's), or has DTensor parameters (tensor parallelism). With no process group, or a plain model, False."""
    if distributed_world() <= 1:
        return False
    wrappers = []
    for module_name, class_name in (("torch.nn.parallel.distributed", "DistributedDataParallel"),
                                    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
                                    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule")):
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None:
            wrappers.append(cls)
    modules = list(model.modules()) if hasattr(model, "modules") else []
    if any(isinstance(m, tuple(wrappers)) for m in modules):
        return True
    if any(engine(m) for m in modules):  # DeepSpeedEngine: ZeRO-3 all-gathers parameters in forward
        return True
    return any(getattr(p, "placements", None) is not None for p in model.parameters()) if modules else True
