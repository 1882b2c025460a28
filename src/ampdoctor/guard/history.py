"""What the guard remembers: one record per observed call, per iteration between two ``update()`` calls, and per
reported finding; the optimizers it has seen; and the weak markers that tell whether the gradients were replaced
since an ``unscale_``.

Records hold references to the user's optimizers only while a call is in flight; seen optimizers and gradients are
held weakly.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ampdoctor.core.findings import Finding
from ampdoctor.core.training import TrainingSetup


@dataclass(eq=False)
class Call:
    """One observed scaler call, and the findings it will prove if it raises."""

    kind: str
    optimizer: Any
    site: str
    scale_calls: int                 # scale() calls earlier in the same iteration
    grad: tuple[weakref.ref, weakref.ref] | None = None   # (param, its .grad) at unscale_
    predicted: list[Finding] = field(default_factory=list)
    implicit: bool = False
    seq: int = 0                     # order among unscale_/step/clip calls
    autocast: tuple[str, str] | None = None   # scale() under autocast: (device type, site)


@dataclass(eq=False)
class Iteration:
    """Everything observed between two ``update()`` calls (or direct optimizer steps, see ``ScalerGuard.iteration``)."""

    index: int
    scale_calls: int = 0
    clips: int = 0
    unscaled: dict[int, Call] = field(default_factory=dict)
    stepped: dict[int, Call] = field(default_factory=dict)
    scheduler_steps: list[tuple[int, str, str]] = field(default_factory=list)   # (id(opt), class, site)
    found_inf: dict[int, list[torch.Tensor]] | None = None   # per optimizer, captured before update()
    last_clip: tuple[int, torch.Tensor] | None = None          # (call number, returned norm)
    backward: bool = False   # a backward of a loss scaled in this iteration ran
    flagged: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Seen:
    """A reported finding, with how many iterations it was seen in and the last of them."""

    finding: Finding
    count: int = 1
    last: int | None = None


class Ledger:
    """The reported findings, one per place (``Finding.place``), each counted over the iterations it was seen in."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, str | None], _Seen] = {}

    def record(self, f: Finding) -> None:
        """Add ``f``, or count one more iteration for the finding with its code and place."""
        key = f.place
        seen = self._seen.get(key)
        if seen is None:
            self._seen[key] = _Seen(f, 1, f.step)
        elif seen.last != f.step:
            seen.count += 1
            seen.last = f.step

    def set_span(self, f: Finding, count: int, last: int) -> None:
        """Set ``f`` as seen in ``count`` iterations, the last of them ``last`` (counted elsewhere, on the device)."""
        self._seen[f.place] = _Seen(f, count, last)

    def replace(self, f: Finding) -> None:
        """Set ``f`` as seen once, replacing the finding with its code and place."""
        self._seen[f.place] = _Seen(f)

    def findings(self) -> list[Finding]:
        """Return each finding once; a repeated one says in how many iterations, from which to which."""
        out = []
        for seen in self._seen.values():
            f = seen.finding
            if seen.count > 1:
                f = replace(f, detail=f"{f.detail} (seen in {seen.count} iterations, {f.step} to {seen.last})")
            out.append(f)
        return out


class Optimizers:
    """The optimizers seen in scaler calls (held weakly) besides the setup's, and the label of each."""

    def __init__(self) -> None:
        self.seen: dict[int, weakref.ref] = {}
        self._labels: dict[int, str] = {}
        self._known: list[Any] | None = None

    def see(self, optimizer: Any) -> None:
        """Remember ``optimizer``, seen in a scaler call."""
        if id(optimizer) not in self.seen:
            self.seen[id(optimizer)] = weakref.ref(optimizer)
            self._known = None

    def known(self, setup: TrainingSetup) -> list[Any]:
        """Return the setup's optimizers and those seen in scaler calls."""
        if self._known is None:
            known = {id(o): o for o in setup.optimizers}
            for key, ref in self.seen.items():
                opt = ref()
                if opt is not None:
                    known.setdefault(key, opt)
            self._known = list(known.values())
        return self._known

    def label(self, optimizer: Any, setup: TrainingSetup) -> str:
        """Return ``optimizer[0] (AdamW)``, computed once per optimizer."""
        label = self._labels.get(id(optimizer))
        if label is None:
            label = self._labels[id(optimizer)] = setup.optimizer_label(optimizer)
        return label

    def label_of(self, key: int, setup: TrainingSetup) -> str:
        """Return the label of the seen optimizer with id ``key``; ``optimizer`` once it is gone."""
        opt = self.seen.get(key)
        return self.label(opt(), setup) if opt is not None and opt() is not None else "optimizer"


def first_grad(optimizer: Any) -> tuple[weakref.ref, weakref.ref] | None:
    """Return weak references to the first parameter with a grad and that grad (bounded scan)."""
    n = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "grad", None) is not None:
                return weakref.ref(p), weakref.ref(p.grad)
            n += 1
            if n >= 16:
                return None
    return None


def first_param_device(optimizer: Any) -> str | None:
    """Return the device type of the optimizer's first parameter, None when it has none."""
    for group in getattr(optimizer, "param_groups", None) or ():
        for p in group["params"]:
            return p.device.type
    return None


def grads_reset(marker: tuple[weakref.ref, weakref.ref] | None) -> bool | None:
    """Return whether the grad seen at an earlier unscale_ was replaced since (zero_grad), None if unknown."""
    if marker is None:
        return None
    param = marker[0]()
    if param is None:
        return None
    return param.grad is None or param.grad is not marker[1]()
