"""The parts of a watch, declared once: what a watch asks each part, and when (pytest's hookspecs, for the watch).

A `ampdoctor.monitor.watcher.Watch` keeps the step clock (which optimizer step is under way, where its gradients
are final, when it ends), the sampling (which steps are looked at closely), the one host copy of a sampled step, and
the flight recorder. Everything it measures is a part's: the gradients, the loss scale, the optimizer's updates, the
loss, the averaged copies, the activations (``ampdoctor.monitor.parts``). Each part is a `WatchPart`: it has a
name (its key in the step line, the summary, an AMP001), the watch-phase rules it emits (``codes``), and the hooks
below; the watch calls each hook of every part in ``order`` and a part implements the ones it needs.

A new part is one file: subclass `WatchPart`, implement `WatchPart.create` and the hooks it needs, and decorate it
with `register_part`; its step-line entries, its summary section (``core.records.Section``) and its findings reach
the console, the JSON, the flight recorder, ``ampdoctor report`` and the HTML page without an edit elsewhere.

A part that raises is reported once as AMP001 under its own name (``ampdoctor.watch (gradients)``) and steps aside
for the rest of the run (`PartsAside`): its hooks are not called again and its `WatchPart.stop` switches off what it
observes (never removing a hook from inside one torch is running: `WatchPart.detach` does that at the end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import nn

from ampdoctor.core.findings import Finding
from ampdoctor.core.host_reads import HostReads
from ampdoctor.core.isolation import StepAside, call_safely
from ampdoctor.core.names import Names
from ampdoctor.core.records import Step, WatchSummary

__all__ = ["WatchContext", "Reading", "WatchPart", "PartsAside", "register_part", "unregister_part", "registered"]


@dataclass
class WatchContext:
    """What a watch hands its parts when it attaches: the objects it follows, their names, how it samples and reads.

    Attributes:
        model: the model the watch follows; models: the run's models it covers, ``model`` first.
        optimizer: the torch optimizer that applies the updates; chain: the optimizer as given, the ones it wraps,
            ..., ``optimizer`` (``core.training.optimizer_chain``).
        scaler: the enabled GradScaler the watch follows, or None.
        loss_scaler: without one, a library's own loss scaler the watch follows (fairseq's ``DynamicLossScaler``,
            DeepSpeed's, ...: ``ampdoctor._compat.loss_scalers``), or None.
        params: the watched tensors (the optimizer's), with their ``names``, ``modules`` and ``dtypes`` as the
            findings name them; owners: per tensor, the index in ``models`` of the model that holds it (None: none).
        prefix: what the names of ``model``'s modules start with in a run of several models.
        every, stats, sample, dense, activations, audit: the watch's settings (``Watch``).
        reads: the watch's host-read counter: a part's own reads count there too (``core.host_reads``).
        names: how the run names the script's objects (``core.names.Names``).
        others, frozen: the run's other models, and what returns the models that ran a forward with nothing to
            train: the look at the forward covers them.
        layouts, padding: per tensor, its layout over the ranks (``_torch.distributed``) and an engine's zero
            padding of it.
        ran: the indices of ``models`` whose forward ran while watched (kept up to date by the watch).
        off: the parts switched off after an internal error (kept up to date by the watch).
        left_out: tensors (or a whole optimizer) whose gradients are left out, with why (an engine's optimizer that
            held no tensor when the watch attached).
        averaged: returns the averaged copies' tensors (an EMA, an ``AveragedModel``), as the averages' part sees
            them, for the state check; None before that part is created.
        steps: returns the optimizer steps completed so far.
        fail: reports an exception of a part (``fail(name, exc)``): AMP001, and the part steps aside.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    chain: list[Any]
    scaler: Any
    params: list[torch.Tensor]
    names: list[str]
    modules: list[str]
    dtypes: list[str]
    prefix: str
    every: int
    stats: str
    sample: int
    dense: int
    activations: bool
    reads: HostReads
    fail: Callable[[str, BaseException], None]
    steps: Callable[[], int]
    run_names: Names = field(default_factory=Names)
    models: list[nn.Module] = field(default_factory=list)
    owners: list[int | None] = field(default_factory=list)
    others: list[nn.Module] = field(default_factory=list)
    frozen: Callable[[], Sequence[nn.Module]] | None = None
    layouts: list[Any] = field(default_factory=list)
    padding: list[int] = field(default_factory=list)
    ran: set[int] = field(default_factory=set)
    off: set[str] = field(default_factory=set)
    left_out: dict[str, str] = field(default_factory=dict)
    loss_scaler: Any = None
    audit: Any = "off"
    averaged: Callable[[], list[tuple[str, str, torch.Tensor]]] | None = None


@dataclass
class Reading:
    """A sampled step whose host copy is being read: its number, whether it is the partial one read at detach (the
    steps since the last sampled one, or a step that never ended), and the step line's entries the parts before
    this one made."""

    step: int
    partial: bool = False
    entries: dict[str, Any] = field(default_factory=dict)

    @property
    def skipped(self) -> bool:
        """Whether the loss scaler skipped this step, as the loss scale's entry says (False without one)."""
        scale = self.entries.get("scale")
        return isinstance(scale, dict) and self.step in scale.get("skipped", ())


class WatchPart:
    """One part of a watch; every hook below does nothing unless the part implements it.

    Class attributes:
        name: the part's key: in the step line, the summary and an AMP001 (``ampdoctor.watch (name)``).
        codes: the watch-phase rule codes whose findings this part emits (each code has exactly one emitter).
        order: when the watch calls it among the parts; the built-in ones are 10 to 60, a part of its own 100.
        immediate: its host values are read at the end of the sampled step, not a step later on CUDA (the activation
            look re-runs a non-finite forward before the next step moves the weights).

    Attributes:
        seconds: spent in the part's own hooks on sampled steps (``Watch.seconds_inside`` counts it).
        collective: its sampled steps issue collectives (sharded gradients): the sampling must then follow the step
            count alone, the same on every rank.
    """

    name: ClassVar[str] = ""
    codes: ClassVar[tuple[str, ...]] = ()
    order: ClassVar[int] = 100
    immediate: ClassVar[bool] = False
    seconds: float = 0.0
    collective: bool = False

    def __init_subclass__(cls, *, name: str | None = None, codes: tuple[str, ...] | None = None,
                          order: int | None = None, immediate: bool | None = None, **kwargs: Any) -> None:
        """Declare a part in its class line: ``class ScalePart(WatchPart, name="scale", codes=("AMP603",))``."""
        super().__init_subclass__(**kwargs)
        for key, value in (("name", name), ("codes", codes), ("order", order), ("immediate", immediate)):
            if value is not None:
                setattr(cls, key, value)

    @classmethod
    def create(cls, ctx: WatchContext) -> "WatchPart | None":
        """Return the part for the watch of ``ctx``, or None when it has nothing to watch there (no GradScaler)."""
        raise NotImplementedError(f"{cls.__name__}.create")

    # ---- attaching ------------------------------------------------------------------------------------------------
    def attach(self) -> None:
        """Register the part's hooks and observers (the watch attaches the parts in ``order``)."""

    def set_sampling(self, active: bool) -> None:
        """The coming step is sampled (``True``), or not: a part does its device work on sampled steps only."""

    # ---- the step clock -------------------------------------------------------------------------------------------
    def step_starting(self) -> bool:
        """An optimizer step starts. Return True when the gradients of its backward calls were reset before it
        (``zero_grad()`` between ``backward()`` and ``step()``): the watch then reads none of them."""
        return False

    def read_point(self, scale: torch.Tensor | None, scaled: bool) -> None:
        """A sampled step's gradients are final (clipped, if the loop clips) and not yet used: read them on the
        device. ``scaled``: they still carry ``scale``, the GradScaler's (or a fused optimizer's ``grad_scale``)."""

    def clipped(self, total_norm: Any, scaled: bool) -> None:
        """A gradient clip returned ``total_norm`` (the norm before clipping) on a sampled step; ``scaled``: it
        clipped the still-scaled gradients (before ``unscale_``)."""

    def count_every_loss(self, hidden_by: str) -> None:
        """The run's log leaves inf/NaN losses out (``hidden_by`` says what does): check every loss (AMP610)."""

    def sampled_step_ending(self) -> None:
        """A sampled step is ending, before its host copy. Called on every rank at every sampled step, also for a
        part that is off and with the watch off: a part that issues collectives issues them here."""

    def step_ended(self) -> None:
        """The step ended (after its host copy)."""

    # ---- the host copy of a sampled step --------------------------------------------------------------------------
    def pending(self, partial: bool) -> dict[str, torch.Tensor] | None:
        """Hand over the device values of this sampled step, for the watch's one host copy (None: the part takes no
        part in this step: it is left out of the copy and not asked to `consume`). ``partial``: read at detach, after
        the last step (the steps since the last sampled one, or a step that never ended)."""
        return None

    def news(self, values: dict[str, torch.Tensor]) -> bool:
        """Whether ``pending``'s ``values`` hold something new since the last sampled step (a detach right after a
        sampled step writes no line when no part has news)."""
        return bool(values)

    def consume(self, host: dict[str, list[float]], reading: Reading) -> dict[str, Any]:
        """Take the host values of `pending`; return this part's entries of the step line, by key (``{}``: none).
        ``reading.entries`` holds the entries of the parts before it."""
        return {}

    def check(self, record: Step, partial: bool) -> None:
        """The sampled step's whole line (``core.records.read_step``): raise the alarms it calls for."""

    def trouble(self, next_step: int) -> None:
        """Trouble was seen (a skipped step, a non-finite gradient): the next steps are sampled, from ``next_step``."""

    # ---- results --------------------------------------------------------------------------------------------------
    def sections(self) -> dict[str, Any]:
        """Return this part's sections of the summary, by key (``core.records.summary``; None: nothing to say)."""
        return {}

    def findings(self, summary: WatchSummary) -> list[Finding]:
        """Return the part's findings so far, with the run's ``summary`` (every part's sections) to read."""
        return []

    # ---- the end --------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Step aside after an internal error: switch the observers off without removing a hook (torch may be
        iterating over the hook dicts); `detach` removes them."""

    def detach(self) -> None:
        """Record what is pending, remove every hook and drop the references to the training objects; the results
        stay."""


_PARTS: list[type[WatchPart]] = []


def register_part(cls: type[WatchPart]) -> type[WatchPart]:
    """Add ``cls`` to the parts every watch attached from now on creates (a class decorator)."""
    if not cls.name:
        raise ValueError(f"a watch part needs a name: {cls.__name__}.name is empty")
    if cls not in _PARTS:
        _PARTS.append(cls)
    return cls


def unregister_part(cls: type[WatchPart]) -> None:
    """Remove ``cls`` from the parts of the watches attached from now on."""
    if cls in _PARTS:
        _PARTS.remove(cls)


def registered() -> list[type[WatchPart]]:
    """Return the parts registered so far, in the order a watch calls them (``monitor.parts.parts`` loads the
    built-in ones first)."""
    return sorted(_PARTS, key=lambda cls: cls.order)


class PartsAside:
    """Which parts of a watch are off after an internal error, each reported once as AMP001 under its own name.

    ``watch`` (the step bookkeeping itself) takes every part with it.

    Args:
        names: the watch's parts (what ``watch`` takes with it).
        step: returns the step an AMP001 is reported at (the watch's step count).
        on_fail: told the name of each part switched off (to stop it).

    >>> aside = PartsAside(["gradients", "scale"], step=lambda: 3)
    >>> aside.guard("scale", lambda: 1 / 0)
    >>> sorted(aside.off), [(f.code, f.where, f.step) for f in aside.findings]
    (['scale'], [('AMP001', 'ampdoctor.watch (scale)', 3)])
    """

    def __init__(self, names: Sequence[str], step: Callable[[], int] = lambda: 0,
                 on_fail: Callable[[str], None] | None = None) -> None:
        self._aside = StepAside("ampdoctor.watch", whole="watch", parts=tuple(names))
        self._step, self._on_fail = step, on_fail

    @property
    def off(self) -> set[str]:
        """The parts switched off."""
        return self._aside.off

    @property
    def findings(self) -> list[Finding]:
        """The AMP001 findings of the parts that failed."""
        return self._aside.findings

    def guard(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` unless ``part`` is off; on an exception switch it off (`fail`), return None."""
        if part in self.off:
            return None
        return call_safely(fn, *args, on_error=lambda exc: self.fail(part, exc), **kwargs)

    def fail(self, part: str, exc: BaseException) -> bool:
        """Switch ``part`` off and report ``exc`` as AMP001; return False if it was off already (nothing done)."""
        if not self._aside.fail(part, exc, self._step()):
            return False
        if self._on_fail is not None:
            call_safely(self._on_fail, part)
        return True
