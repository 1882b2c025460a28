"""The hand-written loss scalers of other libraries: fairseq's, DeepSpeed's, apex's and Megatron-LM's.

They scale the loss as ``torch.amp.GradScaler`` does, but are objects of their own: each decides once per iteration
whether its gradients overflowed (the step is then skipped) in one public method, and keeps its scale in a public
attribute. Nothing is imported: an object is recognised by its class's name and the attributes that library gives
it (fairseq is not installable on recent Pythons, and the others are optional), so a copy of the class with the same
names is recognised too. What each one offers, as of fairseq 3d262bb2, DeepSpeed 0.19, apex before its removal of
``amp`` and Megatron-LM core:

- fairseq ``DynamicLossScaler`` (``fairseq/optim/dynamic_loss_scaler.py``): ``loss_scale``; ``check_overflow(norm)``
  raises ``OverflowError`` on an inf/NaN norm (the trainer skips the step) and ``FloatingPointError`` at
  ``min_loss_scale`` (the run stops).
- DeepSpeed ``DynamicLossScaler``/``LossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``) and apex's
  ``fp16_utils`` ones: ``cur_scale``; ``update_scale(overflow)`` is told whether the step is skipped.
- apex ``amp`` ``LossScaler`` (``apex/amp/scaler.py``): ``loss_scale()``; ``update_scale()`` returns whether the
  step is skipped.
- Megatron-LM ``DynamicGradScaler``/``ConstantGradScaler`` (``megatron/core/optimizer/grad_scaler.py``): ``scale``
  (a one-element tensor); ``update(found_inf)`` is told whether the step is skipped.

An object whose attributes do not fit is not recognised (None): the watch then counts its skipped iterations only
as the backward calls no optimizer step used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["LossScalerShape", "loss_scaler_shape", "SCALER_NAMES"]


@dataclass(frozen=True)
class LossScalerShape:
    """How one library's loss scaler shows its scale and its skip decision.

    Attributes:
        family: the library (``"fairseq"``, ``"DeepSpeed"``, ``"apex"``, ``"Megatron-LM"``).
        names: the class names it has.
        needs: the attributes an object must have to be one.
        method: the method called once per iteration that decides whether the step is skipped.
        minimum: the attribute holding the lowest scale it goes to, "" when it has none.
    """

    family: str
    names: tuple[str, ...]
    needs: tuple[str, ...]
    method: str
    minimum: str
    _scale: Callable[[Any], Any]
    _skipped: Callable[[tuple[Any, ...], dict[str, Any], Any, BaseException | None], bool]

    def fits(self, obj: Any) -> bool:
        """Return whether ``obj`` is one of these scalers: its class name and attributes, and a scale that scales (a
        static scale of 1 scales nothing: DeepSpeed's ZeRO keeps a ``LossScaler(scale=1)`` in bf16 and fp32)."""
        if not (type(obj).__name__ in self.names and all(hasattr(obj, a) for a in self.needs)
                and callable(getattr(obj, self.method, None))):
            return False
        scale = self.scale(obj)
        dynamic = getattr(obj, "dynamic", None) is True or type(obj).__name__.startswith("Dynamic")
        return scale is not None and (dynamic or isinstance(scale, torch.Tensor) or scale != 1.0)

    def label(self, obj: Any) -> str:
        """Return how findings name ``obj``: its class and library (``"DynamicLossScaler (fairseq)"``); the library
        its class comes from, where that is one of the four (apex's ``fp16_utils`` scaler has DeepSpeed's shape)."""
        top = str(getattr(type(obj), "__module__", "")).split(".", 1)[0]
        return f"{type(obj).__name__} ({_LIBRARIES.get(top, self.family)})"

    def scale(self, obj: Any) -> float | torch.Tensor | None:
        """Return the scale the next backward uses: a float, or a one-element tensor (Megatron-LM's, on its device:
        the caller reads it with its own host reads); None when it cannot be read."""
        try:
            value = self._scale(obj)
        except Exception:   # a property that raises on an object not set up yet
            return None
        if isinstance(value, torch.Tensor):
            return value if value.numel() == 1 and value.is_floating_point() else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def skipped(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any = None,
                raised: BaseException | None = None) -> bool:
        """Return whether the call of `method` with ``args`` and ``kwargs``, which returned ``result`` or raised
        ``raised``, skipped the iteration's step."""
        return self._skipped(args, kwargs, result, raised)

    def lowest(self, obj: Any) -> float | None:
        """Return the lowest scale it goes to (fairseq stops the run there, DeepSpeed raises at it), None if unknown
        or not a Python number (Megatron-LM's is a tensor on the GPU: not read)."""
        value = getattr(obj, self.minimum, None) if self.minimum else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


_LIBRARIES = {"fairseq": "fairseq", "deepspeed": "DeepSpeed", "apex": "apex", "megatron": "Megatron-LM"}


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    return args[0] if args else kwargs.get(name)


SHAPES = (
    # fairseq: check_overflow(grad_norm) raises OverflowError (skip) or FloatingPointError (skip, and the run stops)
    LossScalerShape(
        "fairseq", ("DynamicLossScaler",), ("loss_scale", "scale_window", "tolerance", "threshold", "min_loss_scale"),
        "check_overflow", "min_loss_scale", lambda o: o.loss_scale,
        lambda args, kwargs, result, raised: isinstance(raised, (OverflowError, FloatingPointError))),
    # DeepSpeed (and apex's fp16_utils): update_scale(overflow); at its minimum DeepSpeed's raises instead
    LossScalerShape(
        "DeepSpeed", ("DynamicLossScaler", "LossScaler"), ("cur_scale",), "update_scale", "min_scale",
        lambda o: o.cur_scale,
        lambda args, kwargs, result, raised: bool(_argument(args, kwargs, "overflow"))),
    # apex amp: update_scale() returns should_skip
    LossScalerShape(
        "apex", ("LossScaler",), ("dynamic", "clear_overflow_state"), "update_scale", "",
        lambda o: o.loss_scale(),
        lambda args, kwargs, result, raised: result is True),
    # Megatron-LM: update(found_inf); its scale is a tensor on the GPU
    LossScalerShape(
        "Megatron-LM", ("DynamicGradScaler", "ConstantGradScaler"), ("inv_scale",), "update", "min_scale",
        lambda o: o.scale,
        lambda args, kwargs, result, raised: bool(_argument(args, kwargs, "found_inf"))),
)
SCALER_NAMES = frozenset(name for shape in SHAPES for name in shape.names)   # a cheap first test for a scan


def loss_scaler_shape(obj: Any) -> LossScalerShape | None:
    """Return the shape of the hand-written loss scaler ``obj`` (a library's, see the module docstring), None when it
    is not one (a ``torch.amp.GradScaler`` is not: it has its own monitor).

    >>> class DynamicLossScaler:   # fairseq's names
    ...     loss_scale, scale_window, tolerance, threshold, min_loss_scale = 128.0, 2000, 0.0, None, 1e-4
    ...     def check_overflow(self, grad_norm): ...
    >>> loss_scaler_shape(DynamicLossScaler()).label(DynamicLossScaler())
    'DynamicLossScaler (fairseq)'
    >>> loss_scaler_shape(torch.amp.GradScaler("cpu")) is None
    True
    """
    if type(obj).__name__ not in SCALER_NAMES:
        return None
    return next((shape for shape in SHAPES if shape.fits(obj)), None)
