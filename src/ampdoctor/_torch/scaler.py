"""GradScaler internals: the per-optimizer stage, found-inf flags, the live scale and the growth tracker.

`torch.amp.GradScaler` offers no public view of its state machine. These probes read it without ever creating an
entry (``_per_optimizer_states`` is a ``defaultdict``: indexing it would change the scaler). Without the attribute
(a torch that renamed it, or a duck-typed scaler) every probe answers "unknown": the stage is ``READY`` and no
flags are seen, so the guard and the watch stay quiet rather than guess. `unscales_itself` reads the optimizer flag
(``_step_supports_amp_scaling``) that makes ``GradScaler.step`` leave the unscaling to the optimizer.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any

import torch

try:
    from torch.amp.grad_scaler import OptState
except ImportError:  # fallback: the same three stages, so comparisons still work on our side
    class OptState(enum.Enum):  # type: ignore[no-redef]
        READY = 0
        UNSCALED = 1
        STEPPED = 2

__all__ = ["OptState", "optimizer_state", "stage", "found_inf_flags", "live_scale", "growth_tracker",
           "init_scale", "init_growth_tracker", "scaler_device", "is_enabled", "has_state_machine",
           "optimizer_found_inf", "unscales_itself", "patched_to_allow_fp16"]


def has_state_machine(scaler: Any) -> bool:
    """Return whether ``scaler`` exposes the per-optimizer states these probes read."""
    return isinstance(getattr(scaler, "_per_optimizer_states", None), dict)


def optimizer_state(scaler: Any, key: Any) -> dict[str, Any] | None:
    """Return the scaler's state for an optimizer (or its ``id``) without creating one; None when none exists."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return None
    return states.get(key if isinstance(key, int) else id(key))


def stage(scaler: Any, key: Any) -> OptState:
    """Return the optimizer's stage in this iteration (``READY`` when the scaler has not seen it).

    >>> stage(torch.amp.GradScaler("cpu"), object()) is OptState.READY
    True
    """
    state = optimizer_state(scaler, key)
    return state["stage"] if state is not None else OptState.READY


def found_inf_flags(scaler: Any) -> dict[int, list[torch.Tensor]]:
    """Return each optimizer's found-inf flags (one tensor per device) recorded since the last ``update()``."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return {}
    return {key: list(state.get("found_inf_per_device", {}).values()) for key, state in states.items()}


def live_scale(scaler: Any) -> torch.Tensor | None:
    """Return the scale tensor, or None before the first ``scale()`` (lazy init) or on a disabled scaler."""
    value = getattr(scaler, "_scale", None)
    return value if isinstance(value, torch.Tensor) else None


def growth_tracker(scaler: Any) -> torch.Tensor | None:
    """Return the growth-tracker tensor, or None before it is initialised."""
    value = getattr(scaler, "_growth_tracker", None)
    return value if isinstance(value, torch.Tensor) else None


def init_scale(scaler: Any) -> float | None:
    """Return the scale the scaler will start from (its ``init_scale`` or a restored value)."""
    value = getattr(scaler, "_init_scale", None)
    return float(value) if isinstance(value, (int, float)) else None


def init_growth_tracker(scaler: Any) -> int:
    """Return the growth tracker the scaler will start from; non-zero after ``load_state_dict``."""
    value = getattr(scaler, "_init_growth_tracker", 0)
    return int(value) if isinstance(value, int) else 0


def scaler_device(scaler: Any) -> str | None:
    """Return the device type the scaler was built for (``"cuda"``, ``"cpu"``), None when unknown."""
    value = getattr(scaler, "_device", None)
    return value if isinstance(value, str) else None


def is_enabled(scaler: Any) -> bool:
    """Return whether ``scaler`` is an enabled GradScaler (public ``is_enabled()``, else False)."""
    method = getattr(scaler, "is_enabled", None)
    try:
        return bool(method()) if callable(method) else False
    except Exception:
        return False


def optimizer_found_inf(scaler: Any, key: Any) -> list[torch.Tensor] | None:
    """Return one optimizer's found-inf flags since the last ``update()``; None when the scaler has no state for it.

    >>> optimizer_found_inf(torch.amp.GradScaler("cpu"), object()) is None
    True
    """
    state = optimizer_state(scaler, key)
    return None if state is None else list(state.get("found_inf_per_device", {}).values())


def unscales_itself(optimizer: Any) -> bool:
    """Return whether ``optimizer.step`` unscales its own gradients (``_step_supports_amp_scaling``, e.g. fused Adam).

    GradScaler.step then skips its own ``unscale_``.

    >>> unscales_itself(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    False
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def patched_to_allow_fp16(scaler: Any) -> bool:
    """Return whether ``scaler``'s ``_unscale_grads_`` was replaced on the instance by one that accepts float16
    gradients, as kohya-ss/sd-scripts' ``patch_accelerator_for_fp16_training`` does (it passes ``allow_fp16=True``):
    then ``unscale_()`` does not raise "Attempting to unscale FP16 gradients." and fp16 parameters train in place.

    The replacement is tried once on a one-element float16 gradient of ampdoctor's own (a throwaway optimizer:
    nothing of the user's is read or written). A GradScaler without such a patch is never called.

    >>> scaler = torch.amp.GradScaler("cpu")
    >>> patched_to_allow_fp16(scaler)
    False
    >>> original = scaler._unscale_grads_
    >>> scaler._unscale_grads_ = lambda opt, inv, found, allow_fp16: original(opt, inv, found, True)
    >>> patched_to_allow_fp16(scaler)
    True
    """
    replaced = getattr(scaler, "__dict__", {}).get("_unscale_grads_")
    if not callable(replaced) or not is_enabled(scaler):
        return False
    try:   # the pre-flight asks from several rules: try each replacement once (held weakly: no stale ids)
        known = _PATCH_ALLOWS.get(replaced)
        if known is None:
            known = _PATCH_ALLOWS[replaced] = _accepts_fp16(replaced, scaler)
        return known
    except TypeError:   # not weakly referenceable: try it every time
        return _accepts_fp16(replaced, scaler)


_PATCH_ALLOWS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _accepts_fp16(replaced: Any, scaler: Any) -> bool:
    try:
        device = scaler_device(scaler) or "cpu"
        probe = torch.zeros(1, dtype=torch.float16, device=device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        with torch.no_grad():
            replaced(torch.optim.SGD([probe], lr=0.0), torch.ones((), device=device),
                     torch.zeros((), device=device), False)
    except Exception:   # it refused fp16 ("Attempting to unscale FP16 gradients."), or the device is absent
        return False
    return True
