"""Repair a mixed-precision setup in place: upcast trainable low-precision parameters to fp32.

``torch.amp.GradScaler`` is built for fp32 parameters with fp16 activations under ``torch.autocast``. A trainable
fp16 parameter gets an fp16 gradient, which ``GradScaler.unscale_`` refuses with
``ValueError: Attempting to unscale FP16 gradients.``; a bf16 one reaches a CUDA kernel without a bf16 branch; and
an fp16/bf16 optimizer update drops every step smaller than half a unit in the last place of the weight. The repair
every maintainer recommends is to keep the *trainable* parameters in fp32 and let autocast do the low-precision
compute. Frozen parameters stay as they are, so the memory saved by a half-precision base model is kept.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ampdoctor._compat.engines import engine_family
from ampdoctor.core.dtypes import LOW_PRECISION
from ampdoctor.core.training import keeps_fp32_masters
from ampdoctor.repairs._state import (
    Change,
    class_names,
    is_managed,
    migrate_state_,
    owner_refusal,
    short_repr,
    upcast_refusal,
)

__all__ = ["Change", "fix", "upcast_frozen_norms_", "upcast_trainable_params_"]

# Normalization layers take their input's dtype only where autocast says so: CUDA autocast runs layer_norm,
# group_norm and batch_norm in fp32, CPU autocast does not, and CPU kernels accept a half input with fp32 weights
# but not an fp32 input with half weights ("mixed dtype (CPU): expect parameter to have scalar type of Float").
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.BatchNorm1d, nn.BatchNorm2d,
          nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def upcast_trainable_params_(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, dtype: torch.dtype = torch.float32
) -> list[Change]:
    """Upcast every trainable low-precision parameter of ``model`` to ``dtype``, in place.

    The parameter objects stay the same (``p.data`` is replaced), so optimizers, param groups, LR schedulers and
    hooks that hold them keep working. Existing gradients are converted too. With ``optimizer``, its state tensors
    that match a parameter's shape (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) are converted as well, and
    trainable low-precision parameters that only the optimizer holds are upcast under the name ``param[i]``.
    Frozen parameters are left alone. Every value is kept exactly: fp16, bf16 and fp8 all embed in fp32.

    Args:
        model: the module whose parameters are trained.
        optimizer: the optimizer over ``model``'s parameters, whose state should follow (the same order as
            ``fix(model, optimizer)``).
        dtype: the floating dtype to upcast to (keyword only).

    Returns:
        What changed, in order; an empty list when nothing needed changing.

    Raises:
        TypeError: ``model`` is not a module, ``dtype`` is not a floating dtype, or ``optimizer`` is not an optimizer.
        ValueError: a parameter cannot be upcast in place (DTensor, FSDP flat parameter, meta tensor, complex32),
            the model is wrapped in FSDP or DDP (inside it or around it), DeepSpeed / Megatron-LM / apex own it, or
            the optimizer is an ``ampdoctor.MasterWeights``.

    >>> import torch
    >>> model = torch.nn.Linear(2, 2).half()
    >>> [str(c) for c in upcast_trainable_params_(model)]
    ['weight: upcast torch.float16 -> torch.float32', 'bias: upcast torch.float16 -> torch.float32']
    >>> model = torch.nn.Linear(2, 2).half(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> len(upcast_trainable_params_(model, opt)), model.weight.dtype
    (2, torch.float32)
    """
    _check_arguments(model, optimizer, dtype)
    params = list(_trainable_params(model, optimizer))
    to_upcast = [(name, p) for name, p in params if _needs_upcast(p, dtype)]
    _refuse_unsafe_upcast(model, optimizer, params, to_upcast, dtype)
    changes: list[Change] = []
    with torch.no_grad():
        for name, p in to_upcast:
            changes += _upcast_param_(name, p, dtype)
        if optimizer is not None:
            # All trainable parameters, not only those just upcast: a second optimizer over an already fixed
            # model still has its own low-precision state to migrate.
            for name, p in params:
                changes.extend(migrate_state_(optimizer, p, p.dtype, name))
    return changes


def fix(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scaler: torch.amp.GradScaler | None = None
) -> list[Change]:
    """Repair ``model`` for fp16/bf16 autocast training: mutates it in place and returns what changed.

    This is the documented entry point: trainable low-precision parameters become fp32 (with their gradients and
    the optimizer state), frozen ones stay as they are. Run the forward under ``torch.autocast`` afterwards. The
    ``scaler`` is only checked, never modified: every value is kept exactly, so its scale, growth tracker and
    per-optimizer stage stay valid.

    Args:
        model: the module being trained.
        optimizer: its optimizer, whose state is migrated to fp32.
        scaler: the ``torch.amp.GradScaler`` in use, if any.

    Returns:
        What changed; an empty list when the setup was already right.

    >>> import torch
    >>> model = torch.nn.Linear(4, 1).half()
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> len(fix(model, opt)), model.weight.dtype
    (2, torch.float32)
    """
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__} {short_repr(scaler)}. "
            "Pass the scaler you call scaler.scale(loss) on, or leave it out."
        )
    changes = upcast_trainable_params_(model, optimizer)
    if changes:
        changes += upcast_frozen_norms_(model)
    return changes


def upcast_frozen_norms_(model: nn.Module, dtype: torch.dtype = torch.float32) -> list[Change]:
    """Upcast the frozen low-precision parameters and buffers of ``model``'s normalization layers, in place.

    After trainable parameters are upcast, an fp32 activation can reach a frozen fp16 LayerNorm. CUDA autocast
    runs it in fp32; CPU autocast does not, and the forward stops with "mixed dtype (CPU): expect parameter to
    have scalar type of Float". fp32 norms accept fp32 and half inputs alike, cost a few kB, and keep every value
    exactly (peft's ``prepare_model_for_kbit_training`` casts them for the same reason). A layer counts as a
    normalization layer when it is one of torch's or its class name ends in ``Norm`` (``LlamaRMSNorm``,
    ``T5LayerNorm``).

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)).half().requires_grad_(False)
    >>> [(c.name, c.after) for c in upcast_frozen_norms_(model)]
    [('1.weight', 'torch.float32'), ('1.bias', 'torch.float32')]
    """
    changes: list[Change] = []
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if not (isinstance(module, _NORMS) or type(module).__name__.endswith("Norm")):
                continue
            prefix = f"{module_name}." if module_name else ""
            for name, p in module.named_parameters(recurse=False):
                if not p.requires_grad and _needs_upcast(p, dtype) and upcast_refusal(prefix + name, p) is None:
                    changes.append(Change(prefix + name, "upcast frozen norm", str(p.dtype), str(dtype)))
                    p.data = p.data.to(dtype)
            for name, b in module.named_buffers(recurse=False):
                if _needs_upcast(b, dtype):  # BatchNorm's running_mean/var, of a trainable layer or a frozen one
                    changes.append(Change(prefix + name, "upcast norm buffer", str(b.dtype), str(dtype)))
                    setattr(module, name, b.to(dtype))
    return changes


def _check_arguments(model: nn.Module, optimizer: torch.optim.Optimizer | None, dtype: torch.dtype) -> None:
    """Raise on arguments `upcast_trainable_params_` cannot work with, saying what to pass instead."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__} {short_repr(model)}. "
            "Pass the module whose parameters you train (for a Hugging Face pipeline, pipeline.model)."
        )
    if isinstance(optimizer, torch.dtype):
        raise TypeError(
            f"the second argument is the optimizer, got the dtype {optimizer!r}; pass the dtype by name: "
            f"upcast_trainable_params_(model, optimizer, dtype={optimizer!r})"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__} {short_repr(optimizer)}. "
            "Pass the optimizer built over the model's parameters, or leave it out."
        )
    if optimizer is not None and keeps_fp32_masters(optimizer):
        raise ValueError(
            "optimizer is an ampdoctor.MasterWeights, which already keeps fp32 master weights for a model that "
            "stays in half precision; upcasting its parameters would fight it. Call .detach() on it first, then "
            "upcast and use its inner optimizer (.optimizer)."
        )


def _refuse_unsafe_upcast(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                          params: list[tuple[str, torch.Tensor]], to_upcast: list[tuple[str, torch.Tensor]],
                          dtype: torch.dtype) -> None:
    """Raise when a parameter cannot be upcast in place, a wrapper or an engine owns the model, or an
    ``ampdoctor.MasterWeights`` manages a parameter."""
    for name, p in params:
        refusal = upcast_refusal(name, p)
        if refusal is not None and (_needs_upcast(p, dtype) or p.dtype == torch.complex32):
            raise refusal  # checked for all parameters before any is changed, so a refusal leaves the model as it was
    if to_upcast:
        _refuse_wrapped_model(model)
        # a wrapper outside the model (DDP built over it) or an engine that owns it
        refusal = owner_refusal([p for _, p in to_upcast], "upcast", [optimizer] if optimizer is not None else [])
        if refusal is not None:
            raise refusal
    for name, p in to_upcast:
        if is_managed(p):
            raise ValueError(
                f"parameter {name!r} ({p.dtype}) is managed by an ampdoctor.MasterWeights, which keeps its fp32 "
                "master copy; upcasting it in place would fight it. Call .detach() on the MasterWeights first."
            )


def _upcast_param_(name: str, p: torch.Tensor, dtype: torch.dtype) -> list[Change]:
    """Upcast one parameter and its gradient to ``dtype`` in place (under ``no_grad``); return what changed."""
    before = str(p.dtype)
    grad, p.grad = p.grad, None  # a grad must match its parameter's dtype at every moment
    p.data = p.data.to(dtype)
    changes = [Change(name, "upcast", before, str(dtype))]
    if grad is not None:
        p.grad = grad.to(dtype)
        changes.append(Change(name, "grad", str(grad.dtype), str(dtype)))
    return changes


def _needs_upcast(param: torch.Tensor, dtype: torch.dtype) -> bool:
    return param.dtype in LOW_PRECISION and param.dtype.itemsize < dtype.itemsize


def _trainable_params(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, p in model.named_parameters():
        seen.add(id(p))
        if p.requires_grad:
            yield name, p
    if optimizer is None:
        return
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                yield f"param[{index}]", p
            index += 1


def _refuse_wrapped_model(model: nn.Module) -> None:
    for module_name, module in model.named_modules():
        classes = class_names(module)
        where = f"submodule {module_name!r}" if module_name else "the model"
        family = engine_family(module)
        if family is not None:
            raise ValueError(
                f"{where} is a {family} engine ({type(module).__module__}.{type(module).__name__}), which keeps its "
                "own fp32 master copies (and, in fp16, its loss scaler); ampdoctor does not upcast what it owns. Set "
                "the precision in its config (DeepSpeed: the 'fp16'/'bf16' sections) instead."
            )
        if "FullyShardedDataParallel" in classes:
            raise ValueError(
                f"{where} is wrapped in FullyShardedDataParallel ({type(module).__name__}); its parameters are "
                "flat shards that FSDP owns. Keep fp32 sharded parameters and set "
                "MixedPrecision(param_dtype=torch.float16), with ShardedGradScaler, instead of upcasting in place."
            )
        if "DistributedDataParallel" in classes:
            raise ValueError(
                f"{where} is wrapped in DistributedDataParallel ({type(module).__name__}), whose gradient buckets "
                "were sized for the current dtypes. Upcast the bare model before wrapping it: "
                "fix(model, opt); model = DistributedDataParallel(model, ...)."
            )
