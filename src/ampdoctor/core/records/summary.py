"""The watch's summary, typed: one frozen section per part of the watch, and the summary that holds them.

A watch's parts (``monitor.part``) each give their section: the loss scale's (`ScaleSummary`), the gradients'
(`GradientSummary`), the lost updates' and the updates' (`LostSummary`, `UpdatesSummary`), the loss's
(`LossSummary`), the activations' (`ActivationSummary`), the averaged copies' (`AverageCopy`). `WatchSummary` holds
them with the watch's own numbers, what the invariants verified, and what the session adds (which tensors the watch
covers, the earlier stages). It is the end line's ``summary`` and ``Report.extra["watch"]``: ``to_dict`` writes the
JSON, ``from_dict`` reads it back, and every view (the console, ``--json``, the flight recorder, ``ampdoctor report``,
the HTML page, the figures, TensorBoard, the notebook) and the invariants read its attributes, never its keys.

A part this module does not know (one added in a file of its own) gives a `Section` of its own: it is written under
the part's name and read back by its class when that part is loaded (`register_section`), else as a
`GenericSection`; every view shows a section it has no drawing for by its `Section.shown` numbers.

Values read from a file are trusted in nothing (``core.records._values``): a field of the wrong type reads as absent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from ampdoctor.core.records._values import integer, items, mapping, num, number, text

__all__ = ["Section", "GenericSection", "register_section", "Stats", "ScaleSummary", "Arrival", "GradientSummary",
           "EveryLoss", "TensorSeen", "OpSeen", "FrameSeen", "LostSummary", "UpdatesSummary", "LossSummary",
           "FirstNonfinite", "ActivationModule", "ActivationSummary", "AverageCopy", "Verified", "Coverage",
           "StageSummary", "WatchSummary"]

S = TypeVar("S", bound="Section")
_SECTIONS: dict[str, type["Section"]] = {}   # a part's section class by its key in the summary, once loaded


class Section:
    """One part's section of a watch summary: frozen data, written by `to_dict` and read back by `from_dict`."""

    def to_dict(self) -> dict[str, Any]:
        """Return the section as JSON-ready data."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls: type[S], data: Mapping[str, Any]) -> S:
        """Return the section of `to_dict` output; a field of the wrong type reads as absent."""
        raise NotImplementedError

    def shown(self) -> list[tuple[str, str]]:
        """Return the ``(label, value)`` pairs a view shows of this section when it has no drawing of its own: its
        numbers and words at the top level."""
        return [(key, _shown(value)) for key, value in self.to_dict().items() if _shown(value) is not None]


def register_section(key: str, cls: type[S]) -> type[S]:
    """Read the summary's ``key`` as ``cls`` from now on (a part of the watch added in a file of its own)."""
    _SECTIONS[key] = cls
    return cls


@dataclass(frozen=True)
class GenericSection(Section):
    """A section whose part is not loaded in this process: its data as written."""

    data: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GenericSection":
        return cls(dict(data))


def _shown(value: Any) -> str | None:
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return None


def _pairs(value: Any, width: int) -> tuple[tuple[Any, ...], ...]:
    """Read a list of ``width``-long lists as tuples, leaving out the malformed ones."""
    return tuple(tuple(v) for v in items(value) if isinstance(v, list) and len(v) == width)


def _drop_none(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """Return ``data`` without those of ``keys`` whose value is None (an optional field the JSON leaves out)."""
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


# ---- the gradients ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stats:
    """The gradient statistics of one parameter or one module at a sampled step (``core.records.param_stats``,
    ``core.records.rollup``): shares instead of counts.

    ``shares`` holds the ``<format>_<kind>`` columns (``fp16_underflow``, ``bf16_subnormal``, ...), shares of the
    signal entries examined. Without counts (``stats="norms"``) only ``absmax`` and ``l2`` are set.
    """

    absmax: float
    l2: float
    params: int | None = None         # a module's: its parameters with a gradient
    numel: float | None = None        # a module's: their entries
    min_nonzero: float | None = None
    nonfinite: float | None = None
    zero_frac: float | None = None
    sampled: float | None = None      # a parameter's: entries examined
    negligible_frac: float | None = None
    shares: Mapping[str, float] = field(default_factory=dict)

    @property
    def counted(self) -> bool:
        """Whether the counts were computed (``stats`` other than ``"norms"``)."""
        return self.zero_frac is not None

    def share(self, fmt: str, kind: str) -> float:
        """Return the share of the ``kind`` (``underflow``, ``overflow``, ``subnormal``) in format ``fmt``."""
        return self.shares.get(f"{fmt}_{kind}", 0.0)

    def to_dict(self) -> dict[str, Any]:
        out = _drop_none({"params": self.params, "numel": self.numel, "absmax": self.absmax, "l2": self.l2,
                          "min_nonzero": self.min_nonzero, "nonfinite": self.nonfinite, "zero_frac": self.zero_frac,
                          "sampled": self.sampled, "negligible_frac": self.negligible_frac},
                         "params", "numel", "min_nonzero", "nonfinite", "zero_frac", "sampled", "negligible_frac")
        return {**out, **self.shares}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Stats":
        known = ("params", "numel", "absmax", "l2", "min_nonzero", "nonfinite", "zero_frac", "sampled",
                 "negligible_frac")
        shares = {str(k): number(v) for k, v in data.items() if k not in known and number(v) is not None}
        return cls(number(data.get("absmax")) or 0.0, number(data.get("l2")) or 0.0, integer(data.get("params")),
                   number(data.get("numel")), number(data.get("min_nonzero")), number(data.get("nonfinite")),
                   number(data.get("zero_frac")), number(data.get("sampled")), number(data.get("negligible_frac")),
                   shares)


def _stats_by(value: Any) -> dict[str, Stats]:
    return {str(name): Stats.from_dict(s) for name, s in mapping(value).items() if isinstance(s, dict)}


@dataclass(frozen=True)
class Arrival:
    """Which trainable tensors got a gradient on the sampled steps (AMP617): ``params`` of them count (of the models
    the run trains), ``without`` had none on any of the ``reads`` sampled steps; ``outside`` steps no model ran."""

    reads: int = 0
    params: int = 0
    without: tuple[str, ...] = ()
    outside: int = 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reads": self.reads, "params": self.params, "without": list(self.without)}
        if self.outside:
            out["outside"] = self.outside
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Arrival":
        return cls(integer(data.get("reads")) or 0, integer(data.get("params")) or 0,
                   tuple(str(n) for n in items(data.get("without"))), integer(data.get("outside")) or 0)


@dataclass(frozen=True)
class GradientSummary(Section):
    """The gradients' section: the last sampled step's statistics by parameter and by module, the norms, which
    tensors got a gradient, what the statistics leave out, and what a clip did.

    Attributes:
        params, modules: the last sampled step's `Stats` by parameter and by module (``core.records.rollup``).
        arrival: which trainable tensors got a gradient (`Arrival`).
        step, global_norm: the last sampled step and its unscaled global L2 norm (None: none was read).
        max_global_norm: ``(step, norm)`` of the largest finite global norm seen.
        unsummarised: parameters left out of the statistics, with why (a partial DTensor, a sparse gradient).
        merged_over_ranks: ``(parameters, all-reduces so far)`` of the sharded parameters merged over their ranks.
        clipped_nothing: ``(step, global norm)`` of the steps where a clip returned 0 over non-zero gradients.
        pre_clip_norm: the norm the last clip returned (before clipping); clipped_scaled: it clipped the
            still-scaled gradients (AMP408).
    """

    params: Mapping[str, Stats] = field(default_factory=dict)
    modules: Mapping[str, Stats] = field(default_factory=dict)
    arrival: Arrival = Arrival()
    step: int | None = None
    global_norm: float | None = None
    max_global_norm: tuple[int, float] | None = None
    unsummarised: Mapping[str, str] = field(default_factory=dict)
    merged_over_ranks: tuple[int, int] | None = None
    clipped_nothing: tuple[tuple[int, float], ...] = ()
    pre_clip_norm: float | None = None
    clipped_scaled: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"params": {n: s.to_dict() for n, s in self.params.items()},
                               "modules": {m: s.to_dict() for m, s in self.modules.items()}}
        if self.unsummarised:
            out["unsummarised"] = dict(self.unsummarised)
        if self.merged_over_ranks is not None:
            out["merged_over_ranks"] = {"params": self.merged_over_ranks[0], "collectives": self.merged_over_ranks[1]}
        out["arrival"] = self.arrival.to_dict()
        if self.clipped_nothing:
            out["clipped_nothing"] = [list(sn) for sn in self.clipped_nothing]
        if self.pre_clip_norm is not None:
            out["pre_clip_norm"] = self.pre_clip_norm
        if self.clipped_scaled:
            out["clipped_scaled"] = True
        if self.step is not None:
            peak = self.max_global_norm or (self.step, math.nan)
            out.update(step=self.step, global_norm=self.global_norm,
                       max_global_norm={"step": peak[0], "value": peak[1]})
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GradientSummary":
        merged, peak = mapping(data.get("merged_over_ranks")), mapping(data.get("max_global_norm"))
        return cls(
            _stats_by(data.get("params")), _stats_by(data.get("modules")), Arrival.from_dict(mapping(data.get(
                "arrival"))), integer(data.get("step")), num(data.get("global_norm")),
            (integer(peak.get("step")) or 0, num(peak.get("value")) or 0.0) if peak else None,
            {str(k): str(v) for k, v in mapping(data.get("unsummarised")).items()},
            (integer(merged.get("params")) or 0, integer(merged.get("collectives")) or 0) if merged else None,
            tuple((int(s), float(n)) for s, n in _pairs(data.get("clipped_nothing"), 2)
                  if integer(s) is not None and num(n) is not None),
            num(data.get("pre_clip_norm")), data.get("clipped_scaled") is True)


# ---- the loss scale -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScaleSummary(Section):
    """The loss scaler's section: its steps and skipped steps, the scale now, at its peak and lowest, and where it
    changed (``monitor.loss_scale.ScaleMonitor``).

    Attributes:
        steps, skipped: the scaler's steps, and of them the skipped ones; skipped_fraction: their share.
        longest_skip_run: ``(length, first step)`` of the longest run of skipped steps.
        current: the scale after the last step (None: none was read).
        peak, lowest: ``(step, scale)``, or None.
        history: ``(step, scale used from then)`` where the scale changed, the last 200.
        skipped_steps: the skipped steps, the last 200.
        scaler: what scaled the loss: ``"GradScaler"``, or a library's own scaler (``"DynamicLossScaler (fairseq)"``);
            the JSON has it only for the latter.
    """

    steps: int = 0
    skipped: int = 0
    skipped_fraction: float = 0.0
    longest_skip_run: tuple[int, int] = (0, 0)
    current: float | None = None
    peak: tuple[int, float] | None = None
    lowest: tuple[int, float] | None = None
    history: tuple[tuple[int, float], ...] = ()
    skipped_steps: tuple[int, ...] = ()
    scaler: str = "GradScaler"

    def to_dict(self) -> dict[str, Any]:
        def point(p: tuple[int, float] | None) -> dict[str, Any] | None:
            return None if p is None else {"step": p[0], "scale": p[1]}

        return {"steps": self.steps, "skipped": self.skipped, "skipped_fraction": self.skipped_fraction,
                "longest_skip_run": {"length": self.longest_skip_run[0], "first_step": self.longest_skip_run[1]},
                "current": self.current, "peak": point(self.peak), "lowest": point(self.lowest),
                "history": [list(h) for h in self.history], "skipped_steps": list(self.skipped_steps),
                **({} if self.scaler == "GradScaler" else {"scaler": self.scaler})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ScaleSummary":
        def point(value: Any) -> tuple[int, float] | None:
            p = mapping(value)
            step, scale = integer(p.get("step")), num(p.get("scale"))
            return None if step is None or scale is None else (step, scale)

        run = mapping(data.get("longest_skip_run"))
        return cls(integer(data.get("steps")) or 0, integer(data.get("skipped")) or 0,
                   num(data.get("skipped_fraction")) or 0.0,
                   (integer(run.get("length")) or 0, integer(run.get("first_step")) or 0),
                   num(data.get("current")), point(data.get("peak")), point(data.get("lowest")),
                   tuple((int(s), float(v)) for s, v in _pairs(data.get("history"), 2)
                         if integer(s) is not None and num(v) is not None),
                   tuple(s for s in items(data.get("skipped_steps")) if integer(s) is not None),
                   text(data.get("scaler")) or "GradScaler")


# ---- the optimizer's updates -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LostSummary(Section):
    """The lost updates' section: per fp16/bf16 parameter its dtype and the share of its sampled updates that
    rounded away, pooled (``lost_fraction``) over every sampled step (``monitor.updates.UpdateMonitor``)."""

    params: Mapping[str, tuple[str, float]] = field(default_factory=dict)   # name -> (dtype, lost fraction)
    watched: int = 0
    sampled_steps: int = 0
    lost_fraction: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"params": {n: {"dtype": d, "lost_fraction": f} for n, (d, f) in self.params.items()},
                "watched": self.watched, "sampled_steps": self.sampled_steps, "lost_fraction": self.lost_fraction}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LostSummary":
        params = {str(n): (str(mapping(p).get("dtype")), num(mapping(p).get("lost_fraction")))
                  for n, p in mapping(data.get("params")).items()}
        return cls({n: (d, f) for n, (d, f) in params.items() if f is not None}, integer(data.get("watched")) or 0,
                   integer(data.get("sampled_steps")) or 0, num(data.get("lost_fraction")))


@dataclass(frozen=True)
class UpdatesSummary(Section):
    """What the sampled optimizer steps did to the weights: the steps that moved no entry with a non-zero gradient
    (``unmoved_steps``), the share of those entries that moved, and the parameters inf/NaN after a step (with the
    first sampled step they were)."""

    watched: int = 0
    sampled_steps: int = 0
    unmoved_steps: tuple[int, ...] = ()
    moved_fraction: float | None = None
    nonfinite: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"watched": self.watched, "sampled_steps": self.sampled_steps, "unmoved_steps": list(
            self.unmoved_steps), "moved_fraction": self.moved_fraction, "nonfinite": dict(self.nonfinite)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "UpdatesSummary":
        return cls(integer(data.get("watched")) or 0, integer(data.get("sampled_steps")) or 0,
                   tuple(s for s in items(data.get("unmoved_steps")) if integer(s) is not None),
                   num(data.get("moved_fraction")),
                   {str(n): s for n, s in mapping(data.get("nonfinite")).items() if integer(s) is not None})


# ---- the loss ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EveryLoss:
    """Every loss given to backward, checked where the run's log leaves inf/NaN ones out (AMP610)."""

    losses: int = 0
    nonfinite: int = 0
    first: int | None = None
    hidden_by: str = ""


@dataclass(frozen=True)
class LossSummary(Section):
    """The loss's section: the backward calls and the dropped ones, and what the sampled losses did
    (``monitor.backward.BackwardMonitor``).

    Attributes:
        backwards, dropped, dropped_early, steps_ended, zeroed_before_step, unstepped, hand_scaled: the counts of
            backward calls (``monitor.backward``).
        sampled: sampled losses read. With at least one: ``nonfinite`` (the steps with an inf/NaN one, the first
            20), ``last_finite``, ``identical`` (``(length, first step, last step, value)`` of the longest run of
            bit-identical losses); with a finite one: ``first``, ``last``, ``peak`` (``(step, loss)``) and
            ``head_min`` (the lowest of the first quarter). None where there was none.
        every: every loss checked (`EveryLoss`), when the run's log hides the inf/NaN ones.
        nonfinite_forward: ``(step, first module with an inf/NaN output)`` of the sampled steps with an inf/NaN loss
            whose forward was looked at (None: every output finite; ``(input)``: the model's input already was).
    """

    backwards: int = 0
    dropped: int = 0
    dropped_early: int = 0
    steps_ended: int = 0
    zeroed_before_step: int = 0
    unstepped: int = 0
    sampled: int = 0
    hand_scaled: bool = False
    nonfinite: tuple[int, ...] | None = None
    last_finite: bool | None = None
    first: tuple[int, float] | None = None
    last: tuple[int, float] | None = None
    head_min: float | None = None
    peak: tuple[int, float] | None = None
    identical: tuple[int, int, int, float] | None = None
    every: EveryLoss | None = None
    nonfinite_forward: tuple[tuple[int, str | None], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backwards": self.backwards, "dropped": self.dropped,
                               "dropped_early": self.dropped_early, "steps_ended": self.steps_ended,
                               "zeroed_before_step": self.zeroed_before_step, "unstepped": self.unstepped,
                               "sampled": self.sampled, "hand_scaled": self.hand_scaled}
        if self.nonfinite is not None:
            out.update(nonfinite=list(self.nonfinite), last_finite=self.last_finite)
        if self.first is not None:
            out.update(first=self.first, last=self.last, head_min=self.head_min, peak=self.peak)
        if self.identical is not None:
            out["identical"] = list(self.identical)
        if self.every is not None:
            out["every"] = {"losses": self.every.losses, "nonfinite": self.every.nonfinite, "first": self.every.first,
                            "hidden_by": self.every.hidden_by}
        if self.nonfinite_forward:
            out["nonfinite_forward"] = [list(look) for look in self.nonfinite_forward]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LossSummary":
        def point(value: Any) -> tuple[int, float] | None:
            pair = items(value) if isinstance(value, list) else list(value) if isinstance(value, tuple) else []
            return (int(pair[0]), float(pair[1])) if len(pair) == 2 and integer(pair[0]) is not None and \
                num(pair[1]) is not None else None

        same = items(data.get("identical"))
        every = mapping(data.get("every"))
        nonfinite = data.get("nonfinite")
        return cls(
            *(integer(data.get(k)) or 0 for k in ("backwards", "dropped", "dropped_early", "steps_ended",
                                                   "zeroed_before_step", "unstepped", "sampled")),
            data.get("hand_scaled") is True,
            tuple(s for s in nonfinite if integer(s) is not None) if isinstance(nonfinite, list) else None,
            data.get("last_finite") if isinstance(data.get("last_finite"), bool) else None,
            point(data.get("first")), point(data.get("last")), num(data.get("head_min")), point(data.get("peak")),
            (int(same[0]), int(same[1]), int(same[2]), float(same[3])) if len(same) == 4 and all(
                integer(v) is not None for v in same[:3]) and num(same[3]) is not None else None,
            EveryLoss(integer(every.get("losses")) or 0, integer(every.get("nonfinite")) or 0,
                      integer(every.get("first")), text(every.get("hidden_by")) or "") if every else None,
            tuple((int(s), text(m)) for s, m in _pairs(data.get("nonfinite_forward"), 2) if integer(s) is not None))


# ---- the activations -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSeen:
    """A tensor the op-level re-run saw: its role (``input 0``, ``output``), dtype, shape and largest |value|."""

    role: str
    dtype: str
    shape: tuple[int, ...]
    abs_max: float | None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TensorSeen":
        return cls(str(data.get("role")), str(data.get("dtype")), tuple(v for v in items(data.get("shape"))
                                                                       if integer(v) is not None),
                   num(data.get("abs_max")))


@dataclass(frozen=True)
class OpSeen:
    """The op that made an inf/NaN from finite inputs (``monitor.op_replay.NonfiniteOp``), as recorded."""

    op: str
    kind: str
    module: str | None
    module_class: str | None
    module_stack: tuple[str, ...]
    tensors: tuple[TensorSeen, ...]   # its inputs, then its outputs

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OpSeen":
        tensors = [*items(data.get("inputs")), *items(data.get("outputs"))]
        return cls(str(data.get("op")), str(data.get("kind")), text(data.get("module")), text(data.get("module_class")),
                   tuple(str(m) for m in items(data.get("module_stack"))),
                   tuple(TensorSeen.from_dict(t) for t in tensors if isinstance(t, dict)))


@dataclass(frozen=True)
class FrameSeen:
    """A frame of a re-run of the forward (``monitor.replay.Frame``): a module and the smallest non-zero and largest
    |value| of each of its tensors (``rows``: role, abs min, abs max)."""

    module: str
    cls: str
    rows: tuple[tuple[str, float | None, float | None], ...]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FrameSeen":
        rows = tuple((str(r.get("role")), num(r.get("abs_min")), num(r.get("abs_max")))
                     for r in items(data.get("rows")) if isinstance(r, dict))
        return cls(str(data.get("module")), str(data.get("class")), rows)


@dataclass(frozen=True)
class FirstNonfinite:
    """The first inf/NaN in the forward (or the backward) pass: the module, its class, the step, and what a re-run of
    that forward showed (its frames and the op), as the activation monitor recorded it (``data``, which `to_dict`
    writes back as it was)."""

    module: str | None
    cls: str | None
    step: int | None
    kind: str | None
    frames: tuple[FrameSeen, ...] = ()   # the re-run's frames (``monitor.replay.Frame``), none without a re-run
    op: OpSeen | None = None            # the op that made it inf/NaN (``monitor.op_replay.NonfiniteOp``), if found
    data: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FirstNonfinite":
        op = data.get("op")
        return cls(text(data.get("module")), text(data.get("class")), integer(data.get("step")),
                   text(data.get("kind")), tuple(FrameSeen.from_dict(f) for f in items(data.get("frames"))
                                                 if isinstance(f, dict)),
                   OpSeen.from_dict(op) if isinstance(op, dict) else None, dict(data))

    @property
    def label(self) -> str:
        """``module (Class)``, or the module alone."""
        return f"{self.module} ({self.cls})" if self.cls else str(self.module)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


@dataclass(frozen=True)
class ActivationModule:
    """One module's activations over the sampled steps: the largest |output|, its format's maximum and their ratio,
    and the sampled steps with an inf/NaN output and output gradient."""

    cls: str | None = None
    max_abs: float | None = None
    limit: float | None = None
    headroom_ratio: float | None = None
    nonfinite_forward_steps: int = 0
    nonfinite_backward_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"class": self.cls, "max_abs": self.max_abs, "limit": self.limit, "headroom_ratio": self.headroom_ratio,
                "nonfinite_forward_steps": self.nonfinite_forward_steps,
                "nonfinite_backward_steps": self.nonfinite_backward_steps}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ActivationModule":
        return cls(text(data.get("class")), num(data.get("max_abs")), num(data.get("limit")),
                   num(data.get("headroom_ratio")), integer(data.get("nonfinite_forward_steps")) or 0,
                   integer(data.get("nonfinite_backward_steps")) or 0)


@dataclass(frozen=True)
class ActivationSummary(Section):
    """The activations' section (``monitor.activations.ActivationMonitor``): per module its largest |output| and
    headroom, the first inf/NaN forward and backward, and how many steps were looked at; ``culprit``: the module
    the first AMP601 names, as it names it (``2 (Linear)``), which AMP603 names too."""

    enabled: bool = False
    every: int = 1
    headroom_factor: float = 8.0
    sampled_steps: int = 0
    first_nonfinite_module: str | None = None
    first_nonfinite_forward: FirstNonfinite | None = None
    first_nonfinite_backward: FirstNonfinite | None = None
    modules: Mapping[str, ActivationModule] = field(default_factory=dict)
    error: str | None = None
    culprit: str | None = None

    def to_dict(self) -> dict[str, Any]:
        def first(value: FirstNonfinite | None) -> dict[str, Any] | None:
            return None if value is None else value.to_dict()

        return {"enabled": self.enabled, "every": self.every, "headroom_factor": self.headroom_factor,
                "sampled_steps": self.sampled_steps, "first_nonfinite_module": self.first_nonfinite_module,
                "first_nonfinite_forward": first(self.first_nonfinite_forward),
                "first_nonfinite_backward": first(self.first_nonfinite_backward),
                "modules": {n: m.to_dict() for n, m in self.modules.items()}, "error": self.error,
                **({} if self.culprit is None else {"culprit": self.culprit})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ActivationSummary":
        def first(value: Any) -> FirstNonfinite | None:
            return FirstNonfinite.from_dict(value) if isinstance(value, dict) else None

        return cls(data.get("enabled") is True, integer(data.get("every")) or 1,
                   num(data.get("headroom_factor")) or 8.0, integer(data.get("sampled_steps")) or 0,
                   text(data.get("first_nonfinite_module")), first(data.get("first_nonfinite_forward")),
                   first(data.get("first_nonfinite_backward")),
                   {str(n): ActivationModule.from_dict(m) for n, m in mapping(data.get("modules")).items()
                    if isinstance(m, dict)}, text(data.get("error")), text(data.get("culprit")))


# ---- averaged copies -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AverageCopy:
    """One averaged copy of the weights (an EMA, an ``AveragedModel``): its update calls, the sampled ones, and per
    half-precision tensor the share of the sampled entries it had to move that it did not
    (``monitor.averages.AverageMonitor``)."""

    label: str
    calls: int = 0
    sampled: int = 0
    unread: int = 0
    apart: int = 0
    lost: int = 0
    tensors: Mapping[str, float] = field(default_factory=dict)
    dtypes: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "calls": self.calls, "sampled": self.sampled, "unread": self.unread,
                "apart": self.apart, "lost": self.lost, "tensors": dict(self.tensors), "dtypes": dict(self.dtypes)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AverageCopy":
        return cls(text(data.get("label")) or "", *(integer(data.get(k)) or 0 for k in
                                                    ("calls", "sampled", "unread", "apart", "lost")),
                   {str(n): number(v) for n, v in mapping(data.get("tensors")).items() if number(v) is not None},
                   {str(n): str(v) for n, v in mapping(data.get("dtypes")).items()})


# ---- what the run adds ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verified:
    """What the watch verified (``measured``, in words) and what it could not measure (``not_measured``): what an
    all-clear says. ``ok`` is False where an invariant failed (``monitor.verdicts``)."""

    ok: bool = True
    steps: int = 0
    measured: tuple[str, ...] = ()
    not_measured: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "steps": self.steps, "measured": list(self.measured),
                "not_measured": list(self.not_measured)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Verified":
        return cls(data.get("ok") is not False, integer(data.get("steps")) or 0,
                   tuple(str(m) for m in items(data.get("measured"))),
                   tuple(str(m) for m in items(data.get("not_measured"))))


@dataclass(frozen=True)
class Coverage:
    """Which trainable tensors the watch follows when other optimizers step the rest (``session.watching``)."""

    optimizer: str
    other_optimizers: int
    trainable: int
    tensors: int

    def to_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "other_optimizers": self.other_optimizers, "trainable": self.trainable,
                "tensors": self.tensors}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Coverage":
        return cls(text(data.get("optimizer")) or "optimizer", integer(data.get("other_optimizers")) or 0,
                   integer(data.get("trainable")) or 0, integer(data.get("tensors")) or 0)


@dataclass(frozen=True)
class StageSummary:
    """An earlier stage of the run (a k-fold's fold, the run before a resume): its steps and what was verified."""

    steps: int | None = None
    sampled_steps: int | None = None
    verified: Verified | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "sampled_steps": self.sampled_steps,
                "verified": None if self.verified is None else self.verified.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageSummary":
        verified = data.get("verified")
        return cls(integer(data.get("steps")), integer(data.get("sampled_steps")),
                   Verified.from_dict(verified) if isinstance(verified, dict) else None)


# ---- the summary ---------------------------------------------------------------------------------------------
_BUILT_IN: dict[str, type[Section]] = {"scale": ScaleSummary, "gradients": GradientSummary,
                                       "lost_updates": LostSummary, "activations": ActivationSummary,
                                       "updates": UpdatesSummary, "loss": LossSummary}
_OWN = ("steps", "sampled_steps", "every", "stats", "sample", "host_syncs", "log_path", "seconds_inside", "formats",
        *_BUILT_IN, "averages", "off", "verified", "coverage", "stages")


@dataclass(frozen=True)
class WatchSummary:
    """A watch's summary: its own numbers, each part's section, what the invariants verified and what the session
    adds; the end line's ``summary`` and ``Report.extra["watch"]`` (see the module's description).

    Attributes:
        steps: optimizer steps; sampled_steps: of them, the ones looked at closely; every: the sampling interval;
            stats, sample: how the gradient statistics are computed; host_syncs: device-to-host reads made;
            log_path: the flight recorder's file; seconds_inside: time spent inside the watch.
        formats: the formats the run is measured in (``core.formats.run_formats``, chosen once per run).
        scale, gradients, lost_updates, activations, updates, loss, averages: the built-in parts' sections (None:
            that part had nothing to say).
        parts: the sections of other parts, by key (a part added in a file of its own).
        off: the parts switched off after an internal error (AMP001).
        verified: what the invariants verified (`Verified`).
        coverage: which tensors the watch follows of several optimizers' (`Coverage`), or None.
        stages: the run's earlier stages (`StageSummary`).
    """

    steps: int = 0
    sampled_steps: int = 0
    every: int = 50
    stats: str = "full"
    sample: int = 4096
    host_syncs: int = 0
    log_path: str | None = None
    seconds_inside: float = 0.0
    formats: tuple[str, ...] = ()
    scale: ScaleSummary | None = None
    gradients: GradientSummary = GradientSummary()
    lost_updates: LostSummary | None = None
    activations: ActivationSummary | None = None
    updates: UpdatesSummary | None = None
    loss: LossSummary | None = None
    averages: tuple[AverageCopy, ...] | None = None
    parts: Mapping[str, Section] = field(default_factory=dict)
    off: tuple[str, ...] = ()
    verified: Verified | None = None
    coverage: Coverage | None = None
    stages: tuple[StageSummary, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Return the summary as JSON-ready data (``Watch.summary_data()``)."""
        def section(value: Section | None) -> dict[str, Any] | None:
            return None if value is None else value.to_dict()

        out: dict[str, Any] = {
            "steps": self.steps, "sampled_steps": self.sampled_steps, "every": self.every, "stats": self.stats,
            "sample": self.sample, "host_syncs": self.host_syncs, "log_path": self.log_path,
            "seconds_inside": self.seconds_inside, "formats": list(self.formats), "scale": section(self.scale),
            "gradients": self.gradients.to_dict(), "lost_updates": section(self.lost_updates),
            "activations": section(self.activations), "updates": section(self.updates), "loss": section(self.loss),
            "averages": None if self.averages is None else [copy.to_dict() for copy in self.averages],
            "off": list(self.off)}
        out.update((key, value.to_dict()) for key, value in self.parts.items())
        if self.verified is not None:
            out["verified"] = self.verified.to_dict()
        if self.coverage is not None:
            out["coverage"] = self.coverage.to_dict()
        if self.stages:
            out["stages"] = [stage.to_dict() for stage in self.stages]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "WatchSummary":
        """Return the summary of `to_dict` output (a JSON report's ``watch``, a flight recorder's end line)."""
        def section(key: str) -> Any:
            value = data.get(key)
            return _BUILT_IN[key].from_dict(value) if isinstance(value, dict) else None

        verified, coverage = data.get("verified"), data.get("coverage")
        averages = data.get("averages")
        return cls(
            integer(data.get("steps")) or 0, integer(data.get("sampled_steps")) or 0, integer(data.get("every")) or 50,
            text(data.get("stats")) or "full", integer(data.get("sample")) or 4096,
            integer(data.get("host_syncs")) or 0, text(data.get("log_path")), num(data.get("seconds_inside")) or 0.0,
            tuple(f for f in items(data.get("formats")) if isinstance(f, str)), section("scale"),
            section("gradients") or GradientSummary(), section("lost_updates"), section("activations"),
            section("updates"), section("loss"),
            tuple(AverageCopy.from_dict(c) for c in averages if isinstance(c, dict))
            if isinstance(averages, list) else None,
            {str(k): _SECTIONS.get(k, GenericSection).from_dict(v) for k, v in data.items()
             if k not in _OWN and isinstance(v, dict)},
            tuple(str(p) for p in items(data.get("off"))),
            Verified.from_dict(verified) if isinstance(verified, dict) else None,
            Coverage.from_dict(coverage) if isinstance(coverage, dict) else None,
            tuple(StageSummary.from_dict(s) for s in items(data.get("stages")) if isinstance(s, dict)))

    def shown_parts(self) -> Iterable[tuple[str, list[tuple[str, str]]]]:
        """Yield ``(key, its shown numbers)`` of each other part's section, for a view that has no drawing of it."""
        for key, section in self.parts.items():
            shown = section.shown()
            if shown:
                yield key, shown

    @property
    def looked_at_every_step(self) -> bool:
        """Whether the activation monitor looked at the forward of every step."""
        return self.activations is not None and self.activations.sampled_steps >= self.steps

    _FIELDS: ClassVar[tuple[str, ...]] = _OWN
