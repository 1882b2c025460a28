"""The process-wide events of a run: what the observers of torch's own functions tell the run's lifecycle.

torch offers no hook for a gradient clip or a restored state dict, so ``session.observers.GlobalObservers`` wraps
those functions (pass-through) and calls one ``RunEvents`` object, the run's `ampdoctor.session.session.Session`.
The events are declared here once; the session hands each on to the parts that care (the GradScaler guard, the
watch, the clip norms).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["RunEvents"]


class RunEvents(Protocol):
    """What a run is told about calls that no torch hook reports. Each method runs inside the user's call."""

    def before_clip(self, parameters: Any, args: tuple, kwargs: dict, name: str = "clip_grad_norm_") -> None:
        """A clip starts: ``name`` is ``clip_grad_norm_``, ``clip_grad_value_`` or FSDP's ``clip_grad_norm_``;
        ``parameters``, ``args`` and ``kwargs`` are what it was called with (``args[0]`` is ``max_norm``)."""

    def after_clip(self, result: Any, report_norm: bool = True) -> None:
        """The outermost clip returned ``result`` (the total norm before clipping; None from a clip by value).
        ``report_norm`` is False inside a framework's clip wrapper, which reports the norm itself."""

    def wrapper_clipped(self, max_norm: Any, result: Any) -> None:
        """A framework's clip wrapper (``accelerate.Accelerator.clip_grad_norm_``) returned ``result``, the total
        norm before clipping, for ``max_norm``; torch's clips it ran were reported with ``report_norm=False``."""

    def optimizer_restored(self, optimizer: Any) -> None:
        """``optimizer.load_state_dict`` returned: a resume (accelerate's placement reload is not one)."""

    def scaler_restored(self, scaler: Any) -> None:
        """A GradScaler's ``load_state_dict`` returned."""
