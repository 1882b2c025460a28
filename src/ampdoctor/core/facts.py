"""What process-wide observers saw happen to training objects: how GradScalers were built, what was restored.

Some questions cannot be answered from an object's state. A ``GradScaler("cuda", enabled=False)`` and one that
disabled itself because CUDA is missing look the same afterwards, and an optimizer restored from a checkpoint may
keep no step counter. `ampdoctor run` observes the calls themselves and records the answers here; `check()` on
objects built elsewhere has no facts, and rules that need them stay quiet rather than guess.
"""

from __future__ import annotations

import weakref
from typing import Any

from ampdoctor.core.training import optimizer_chain


class ProcessFacts:
    """Facts about training objects, held by identity and weakly (they never keep an object alive).

    >>> import torch
    >>> facts = ProcessFacts()
    >>> scaler = torch.amp.GradScaler("cpu", enabled=False)
    >>> facts.record_scaler_built(scaler, requested_enabled=False)
    >>> facts.scaler_requested_enabled(scaler), facts.scaler_restored(scaler)
    (False, False)
    """

    def __init__(self) -> None:
        self._restored_optimizers: weakref.WeakSet = weakref.WeakSet()
        self._restored_scalers: weakref.WeakSet = weakref.WeakSet()
        self._requested_enabled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._precision_fallbacks: list[tuple[str, str, str]] = []

    def record_scaler_built(self, scaler: Any, requested_enabled: bool) -> None:
        """Record the ``enabled`` argument a GradScaler was constructed with."""
        self._requested_enabled[scaler] = bool(requested_enabled)

    def scaler_requested_enabled(self, scaler: Any) -> bool | None:
        """Return the ``enabled`` argument ``scaler`` was built with, None when its construction was not seen."""
        return self._requested_enabled.get(scaler)

    def record_precision_fallback(self, framework: str, asked: str, got: str) -> None:
        """Record that ``framework`` (``Fabric``, ``Trainer``) was asked for precision ``asked`` and set up ``got``."""
        if (framework, asked, got) not in self._precision_fallbacks:
            self._precision_fallbacks.append((framework, asked, got))

    def precision_fallbacks(self) -> list[tuple[str, str, str]]:
        """Return each framework object's precision that differs from the one asked: (framework, asked, got)."""
        return list(self._precision_fallbacks)

    def record_optimizer_restored(self, optimizer: Any) -> None:
        """Record that ``optimizer.load_state_dict`` ran."""
        self._restored_optimizers.add(optimizer)

    def record_scaler_restored(self, scaler: Any) -> None:
        """Record that ``scaler.load_state_dict`` ran."""
        self._restored_scalers.add(scaler)

    def optimizer_restored(self, optimizer: Any) -> bool:
        """Return whether ``optimizer`` (or an optimizer it wraps) had its state loaded."""
        return any(o in self._restored_optimizers for o in optimizer_chain(optimizer))

    def scaler_restored(self, scaler: Any) -> bool:
        """Return whether ``scaler.load_state_dict`` ran."""
        return scaler in self._restored_scalers
