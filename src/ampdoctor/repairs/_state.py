"""What the repairs share: the record of a change, optimizer-state migration, refusals, managed parameters.

Both repairs (`upcast` and `master_weights`) build on this module and never on each other.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ampdoctor._compat.engines import find_engines
from ampdoctor._torch.distributed import is_flat_param
from ampdoctor._torch.engines import ddp_wrappers
from ampdoctor.core.dtypes import HALF

# Parameters with an attached MasterWeights, each to a weak reference to it (a strong one would keep the wrapper, and
# through it the parameter, alive for good). Keyed by identity: a WeakSet would compare tensors with ==.
_MANAGED: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Change:
    """One thing a fix changed.

    Attributes:
        name: qualified parameter name (``"encoder.0.weight"``), or ``"param[3]"`` for a parameter that only the
            optimizer knows, numbered as in ``optimizer.state_dict()``.
        what: what was changed: ``"upcast"`` (the parameter), ``"grad"`` or ``"optimizer state exp_avg"``.
        before: dtype before, as ``str(dtype)``.
        after: dtype after.
    """

    name: str
    what: str
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.name}: {self.what} {self.before} -> {self.after}"

    def to_dict(self) -> dict[str, str]:
        """Return the change as a JSON-ready dict."""
        return dataclasses.asdict(self)


def is_managed(param: torch.Tensor) -> bool:
    """Return True if ``param`` is managed by a ``MasterWeights`` that is still attached."""
    return param in _MANAGED


def set_managed(param: torch.Tensor, owner: Any | None) -> None:
    """Record that the ``MasterWeights`` ``owner`` now manages ``param`` (None: that none does any more)."""
    if owner is not None:
        _MANAGED[param] = weakref.ref(owner)
    else:
        _MANAGED.pop(param, None)


def manager_of(param: torch.Tensor) -> Any | None:
    """Return the attached ``MasterWeights`` that manages ``param``, or None."""
    owner = _MANAGED.get(param)
    return None if owner is None else owner()


def upcast_refusal(name: str, param: torch.Tensor) -> Exception | None:
    """Return the error explaining why ``param`` cannot be replaced in place by an fp32 copy, or None if it can."""
    classes = class_names(param)
    if "DTensor" in classes:
        placements = getattr(param, "placements", None)
        return ValueError(
            f"parameter {name!r} is a DTensor ({param.dtype}, placements={placements!r}); replacing one shard's data "
            "in place would leave the other ranks and FSDP2's bookkeeping in the old dtype. Shard fp32 parameters "
            "and ask FSDP for the compute dtype: fully_shard(model, mp_policy=MixedPrecisionPolicy("
            "param_dtype=torch.float16)), with ShardedGradScaler for fp16."
        )
    # FlatParameter's class is plain Parameter (a metaclass makes isinstance work); the flag is what it sets.
    if "FlatParameter" in classes or is_flat_param(param):
        return ValueError(
            f"parameter {name!r} is an FSDP FlatParameter ({param.dtype}, {param.numel()} elements); FSDP owns its "
            "views and dtype, so it cannot be upcast in place. Build FSDP over fp32 parameters with "
            "MixedPrecision(param_dtype=torch.float16) and use ShardedGradScaler."
        )
    if param.is_meta:
        return ValueError(
            f"parameter {name!r} is on the meta device ({param.dtype}, shape {list(param.shape)}), so it has no data "
            "to upcast. Materialize the model first (model.to_empty(device=...) and load the weights), then fix it."
        )
    if param.dtype == torch.complex32:
        return ValueError(
            f"parameter {name!r} is complex ({param.dtype}); ampdoctor upcasts real floating parameters only. "
            "Convert it yourself if that is what you want: p.data = p.data.to(torch.complex64)."
        )
    return None


def master_refusal(name: str, param: torch.Tensor) -> Exception | None:
    """Return the error explaining why ``MasterWeights`` cannot keep an fp32 master of ``param``, or None."""
    refusal = upcast_refusal(name, param)
    if refusal is None and param.dtype not in HALF:
        refusal = ValueError(
            f"parameter {name!r} is {param.dtype}; MasterWeights keeps fp16/bf16 compute copies, and fp8 training "
            "needs scaled matmuls. Use torchao's float8 training, or upcast it first."
        )
    if refusal is None and is_managed(param):
        refusal = ValueError(f"parameter {name!r} ({param.dtype}) already has a MasterWeights; detach that one first.")
    return refusal


def owner_refusal(params: list[torch.Tensor], repair: str, optimizers: list[Any] = ()) -> Exception | None:
    """Return why ``repair`` must not change ``params``: a DDP reducer or a training engine owns them; else None.

    DDP's reducer built flat per-dtype gradient buckets for these parameters when it was constructed
    (``reducer.cpp``, ``check_grad_layout``: "Expected <T>, got <U>"), and DeepSpeed, Megatron-LM and apex keep
    their own fp32 masters and loss scaler.
    """
    engines = find_engines([], optimizers, (), params)
    if engines:
        engine = engines[0]
        return ValueError(
            f"{repair} refused: these parameters belong to {engine.family} ({engine.label}), which keeps its own fp32 "
            "master copies (and, in fp16, its loss scaler and overflow check). Set the precision in the engine's own "
            "config (DeepSpeed: 'fp16'/'bf16' sections; Megatron-LM: --fp16/--bf16) rather than upcasting or wrapping "
            "what it owns."
        )
    wrappers = ddp_wrappers(params)
    if wrappers:
        ddp = wrappers[0]
        return ValueError(
            f"{repair} refused: the model is wrapped in DistributedDataParallel (over {type(ddp.module).__name__}, "
            f"gradient_as_bucket_view={getattr(ddp, 'gradient_as_bucket_view', '?')}), whose reducer built its "
            "gradient buckets for the parameters' current dtype and reduces them during backward; changing their "
            "dtype or swapping their .data/.grad breaks it ('Expected <T>, got <U>'). Either keep fp32 parameters "
            "and run the forward under torch.autocast, or repair the bare model before wrapping it: "
            "ampdoctor.fix(model, opt); model = DistributedDataParallel(model, ...)."
        )
    return None


def migrate_state_(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, dtype: torch.dtype, name: str
) -> list[Change]:
    """Convert ``optimizer``'s lower-precision state tensors of ``param`` (same shape) to ``dtype``, in place."""
    state = optimizer.state.get(param)  # .get: optimizer.state is a defaultdict, indexing would add an entry
    if not state:
        return []
    changes = []
    for key, value in list(state.items()):
        # "step" is a counter (a 0-dim fp32 tensor, or a float): it has the shape of a 0-dim parameter, never a
        # lower precision to lose, and fused/capturable optimizers expect it where it is.
        if key == "step" or not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if value.shape == param.shape and value.dtype.itemsize < dtype.itemsize:
            state[key] = value.to(dtype)
            changes.append(Change(name, f"optimizer state {key}", str(value.dtype), str(dtype)))
    return changes


def class_names(obj: Any) -> set[str]:
    # Names, not isinstance: works without importing torch.distributed, and across its module moves
    # (torch.distributed._tensor -> torch.distributed.tensor).
    return {cls.__name__ for cls in type(obj).__mro__}


def short_repr(obj: Any, limit: int = 60) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_master_state_dict(state_dict: Any, positions: list[int],
                            masters: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Return the saved masters of a ``MasterWeights.state_dict()``; raise ValueError if it does not fit."""
    if not isinstance(state_dict, dict) or set(state_dict) != {"optimizer", "master_weights"}:
        got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"expected a MasterWeights state dict with keys ['master_weights', 'optimizer'], got {got!r}. "
            "Pass what MasterWeights.state_dict() returned; load a plain optimizer's state dict with "
            ".optimizer.load_state_dict(...) instead."
        )
    saved = state_dict["master_weights"]
    if set(saved) != set(positions):
        raise ValueError(
            f"the state dict has masters for parameters {sorted(saved)}, but this MasterWeights wraps "
            f"{sorted(positions)}. Build the optimizer over the same parameters, in the same order and dtypes."
        )
    for index, master in zip(positions, masters):
        if tuple(saved[index].shape) != tuple(master.shape):
            raise ValueError(
                f"saved master for parameter {index} has shape {list(saved[index].shape)}, the parameter has "
                f"{list(master.shape)}. Build the model and optimizer as they were when the state was saved."
            )
    return saved
