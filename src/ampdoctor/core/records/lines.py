"""The flight recorder's lines, defined once: built by the watch's parts, read by every view through typed views.

A flight recorder (``core.records.file`` writes and parses the file) is JSON lines: a ``header`` line, one
``step`` line per sampled step, an ``end`` line when the watch closes, and the run's ``report`` line when
``ampdoctor run`` appends it. The monitors build their parts of a line with the builders here; every view (the
watch summary, ``ampdoctor report`` on the console, the HTML page, the PNG figures, TensorBoard, ``advise``) reads
the lines through the typed views here (`read_recording`), and a module's numbers come from the one roll-up,
`rollup`, so no two views can disagree.

A step's ``gradients.rows`` hold one row of counts per parameter (never fractions); the header names the columns
(``grad_columns``: ``ampdoctor.monitor.grad_stats.COLUMNS``, passed in by the monitors, as core imports no monitor)
and the parameters (``params``: name, module, dtype). ``zero_frac`` and ``negligible_frac`` are counts over
``numel``; ``<fmt>_underflow`` / ``_overflow`` / ``_subnormal`` are counts over the signal entries examined
(``sampled_nonzero``), for one parameter and for a module alike.

Schemas. ``ampdoctor.watch/2`` records a step's lost updates as counts (per parameter, entries with a non-zero
gradient that moved and that were lost, and the step's totals and fraction). ``ampdoctor.watch/1`` logs stay
readable: their per-parameter fractions are kept, and what they lack (a step's pooled fraction) is said in
``Recording.notes``. Values from a file are trusted in nothing: a field of the wrong type reads as absent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ampdoctor.core.findings import Finding
from ampdoctor.core.records._values import integer as _int
from ampdoctor.core.records._values import items as _list
from ampdoctor.core.records._values import mapping as _dict
from ampdoctor.core.records._values import num as _num
from ampdoctor.core.records._values import text as _str
from ampdoctor.core.records.report_json import read_finding
from ampdoctor.core.records.summary import WatchSummary

__all__ = ["WATCH_SCHEMA", "OLD_WATCH_SCHEMAS", "header_line", "step_line", "end_line", "report_line", "is_header",
           "header_problem",
           "gradient_rows", "gradients_entry", "scale_entry", "lost_updates_entry", "updates_entry", "loss_entry",
           "param_stats", "rollup", "Layout", "Header", "Gradients", "Scale", "ParamLost", "LostUpdates", "Updates",
           "Loss", "Activations", "Step", "End", "Recording", "read_step", "read_recording"]

WATCH_SCHEMA = "ampdoctor.watch/2"
OLD_WATCH_SCHEMAS = {  # readable older schemas: what their logs lack
    "ampdoctor.watch/1": "its lost updates are per-parameter fractions without their counts, so a step's share of "
                         "lost updates (the lost-update series and figure) cannot be computed; the per-parameter "
                         "fractions are kept. A run recorded by this ampdoctor has them",
}
SHARES = ("_underflow", "_overflow", "_subnormal")  # columns counted among the signal entries (sampled_nonzero)
_COUNTS = ("min_nonzero", "nonfinite", "zeros", "negligible", "sampled", "sampled_nonzero")


# ---- writing: the lines and their entries ----------------------------------------------------------------------
def header_line(fields: Mapping[str, Any], *, started: float, pid: int, rank: int | None = None,
                world_size: int | None = None) -> dict[str, Any]:
    """Return the header line: the schema, when and which process started, its rank, then ``fields``.

    >>> header_line({"every": 1}, started=0.0, pid=7, rank=1, world_size=2)["schema"]
    'ampdoctor.watch/2'
    """
    where = {} if rank is None else {"rank": rank, "world_size": world_size}
    return {"type": "header", "schema": WATCH_SCHEMA, "started": started, "pid": pid, **where, **fields}


_ENTRIES = ("gradients", "scale", "lost_updates", "activations", "updates", "loss")   # the built-in parts' entries


def step_line(step: int, t: float, *, partial: bool = False, **entries: Any) -> dict[str, Any]:
    """Return a sampled step's line: the parts' entries by key (the built-in ones first, in this order: gradients,
    scale, lost_updates, activations, updates, loss; None: left out); ``partial``: written at detach, for the steps
    since the last sampled one.

    >>> step_line(3, 0.5, scale={"skipped": []}, partial=True)
    {'type': 'step', 'step': 3, 't': 0.5, 'scale': {'skipped': []}, 'partial': True}
    """
    ordered = {key: entries[key] for key in _ENTRIES if entries.get(key) is not None}
    ordered.update((key, entry) for key, entry in entries.items() if key not in _ENTRIES and entry is not None)
    return {"type": "step", "step": step, "t": t, **ordered, **({"partial": True} if partial else {})}


def end_line(*, steps: int, summary: Any = None, environment: Any = None,
             findings: Iterable[Finding] = ()) -> dict[str, Any]:
    """Return the line a watch writes when it closes: its step count, summary, environment and findings.

    >>> end_line(steps=3)
    {'type': 'end', 'steps': 3, 'summary': None, 'environment': None, 'findings': []}
    """
    return {"type": "end", "steps": steps, "summary": summary, "environment": environment,
            "findings": [f.to_dict() for f in findings]}


def report_line(report: Mapping[str, Any]) -> dict[str, Any]:
    """Return the line that holds the run's whole report (``Report.to_dict()``).

    >>> report_line({"schema": "ampdoctor.core.report/1"})["type"]
    'report'
    """
    return {"type": "report", "report": dict(report)}


def is_header(line: Any) -> bool:
    """Whether ``line`` (parsed JSON) is a flight recorder's header line.

    >>> is_header({"type": "header", "schema": WATCH_SCHEMA}), is_header({"schema": "ampdoctor.core.report/1"})
    (True, False)
    """
    return isinstance(line, Mapping) and line.get("type") == "header"


def header_problem(header: Mapping[str, Any]) -> str | None:
    """Return what is wrong with a header line's schema, or None for this one and the older ones still read.

    >>> header_problem({"schema": "ampdoctor.watch/1"}), header_problem({"schema": "x/9"})[:24]
    (None, "header schema 'x/9', exp")
    """
    schema = header.get("schema")
    if schema == WATCH_SCHEMA or schema in OLD_WATCH_SCHEMAS:
        return None
    older = ", ".join(map(repr, OLD_WATCH_SCHEMAS))
    return f"header schema {schema!r}, expected {WATCH_SCHEMA!r} (or an older {older})"


def gradient_rows(flat: Sequence[float], width: int) -> list[list[float]]:
    """Cut the host copy of the statistics (``width`` values per parameter) into one row per parameter."""
    return [list(flat[i:i + width]) for i in range(0, len(flat), width)]


def gradients_entry(rows: list[list[float]], columns: Sequence[str], *, read: str, loss_scale: float | None = None,
                    clip: Sequence[float] | None = None) -> dict[str, Any]:
    """Return a step's ``gradients`` entry: how they were read, the loss scale, the global L2 norm and the rows.

    Args:
        rows: one row of counts per parameter, in the header's order (see `gradient_rows`).
        columns: the names of the row's values (the header's ``grad_columns``).
        read: ``"scaled"`` or ``"unscaled"``: whether the gradients still carried the loss scale.
        loss_scale: the loss scale the statistics assumed, if known.
        clip: ``[returned norm, 1 if it clipped still-scaled gradients, 1 if a norm was returned]``, if clipped.

    >>> entry = gradients_entry([[1, 2, 3.0, 1.0, 3.0], [1, 2, 4.0, 1.0, 4.0]], ["has_grad", "numel", "absmax",
    ...                         "min_nonzero", "l2"], read="scaled", loss_scale=1024.0)
    >>> entry["global_norm"], entry["loss_scale"]
    (5.0, 1024.0)
    """
    col = {name: i for i, name in enumerate(columns)}
    norms = [row[col["l2"]] for row in rows if row[col["has_grad"]]]
    entry: dict[str, Any] = {"read": read, "loss_scale": loss_scale,
                             "global_norm": math.sqrt(sum(n * n for n in norms)) if norms else None, "rows": rows}
    if clip is not None:  # clip_grad_norm_ returns the norm before clipping; on still-scaled gradients, scaled
        norm, scaled, returned = clip
        entry["clipped_scaled"] = scaled > 0
        if returned:
            entry["pre_clip_norm"] = norm
    return entry


def scale_entry(first: int, end: int, scale: float | None, changes: list[list[float]], skipped: list[int],
                skipped_total: int, skip_run: int) -> dict[str, Any]:
    """Return a step's ``scale`` entry: the GradScaler's steps ``first`` to ``end`` since the last sampled step,
    the scale after them, where it changed (``[step, scale used from then]``), the steps skipped among them, all
    steps skipped so far and the current run of skips.

    >>> scale_entry(4, 6, 512.0, [[5, 512.0]], [4], 3, 0)["steps"]
    [4, 6]
    """
    return {"steps": [first, end], "scale": scale, "scale_changes": changes, "skipped": skipped,
            "skipped_total": skipped_total, "skip_run": skip_run}


def lost_updates_entry(counts: Iterable[tuple[str, int, int]]) -> dict[str, Any]:
    """Return a step's ``lost_updates`` entry from ``(parameter, entries that should move, of those lost)``.

    >>> lost_updates_entry([("w", 8, 6), ("b", 2, 0), ("frozen", 0, 0)])
    {'params': {'w': {'moved': 8, 'lost': 6}, 'b': {'moved': 2, 'lost': 0}}, 'moved': 10, 'lost': 6, 'fraction': 0.6}
    """
    params = {name: {"moved": moved, "lost": lost} for name, moved, lost in counts if moved}
    moved, lost = sum(p["moved"] for p in params.values()), sum(p["lost"] for p in params.values())
    return {"params": params, "moved": moved, "lost": lost, "fraction": lost / moved if moved else None}


def updates_entry(*, stepped: int, expected: int, moved: int, nonfinite: Sequence[str],
                  skipped: bool = False) -> dict[str, Any]:
    """Return a step's ``updates`` entry: optimizer steps counted, sampled entries with a non-zero gradient in groups
    with lr > 0 and of those the ones that changed, the parameters inf/NaN at the end of the step, and whether a
    scaler reported the step as skipped.

    >>> updates_entry(stepped=1, expected=10, moved=9, nonfinite=[])
    {'stepped': 1, 'expected': 10, 'moved': 9, 'nonfinite': []}
    """
    return {"stepped": stepped, "expected": expected, "moved": moved, "nonfinite": list(nonfinite),
            **({"skipped": True} if skipped else {})}


def loss_entry(value: float, backwards: int, dropped: int) -> dict[str, Any]:
    """Return a step's ``loss`` entry: the last loss given to backward (divided by a GradScaler's scale), the
    backward calls since the last step line, and of those the ones whose gradients were dropped unused.

    >>> loss_entry(0.5, 2, 0)
    {'value': 0.5, 'backwards': 2, 'dropped': 0}
    """
    return {"value": value, "backwards": backwards, "dropped": dropped}


# ---- the roll-up: rows of counts -> per-parameter and per-module statistics ------------------------------------
def param_stats(rows: Sequence[Sequence[float] | None], columns: Sequence[str],
                names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Return ``{parameter: {stat: value}}`` of one step's rows, with fractions instead of counts.

    ``zero_frac`` and ``negligible_frac`` are of all entries; ``<fmt>_underflow`` / ``_overflow`` / ``_subnormal``
    are of the signal entries examined (finite, above the floor); ``min_nonzero`` is the smallest finite non-zero
    |g| examined. Rows without a gradient (or None) are left out; without counts (``stats="norms"``) only
    ``absmax`` and ``l2`` are given.

    >>> cols = ["has_grad", "numel", "absmax", "min_nonzero", "l2", "nonfinite", "zeros", "negligible", "sampled",
    ...         "sampled_nonzero", "fp16_underflow"]
    >>> param_stats([[1, 4, 3.0, 0.5, 3.1, 0, 1, 0, 4, 3, 1]], cols, ["w"])["w"]["fp16_underflow"]
    0.3333333333333333
    """
    return {name: _stats([row], columns, module=False) for name, row in zip(names, rows)
            if row is not None and row[columns.index("has_grad")]}


def rollup(rows: Sequence[Sequence[float] | None], columns: Sequence[str],
           modules: Sequence[str]) -> dict[str, dict[str, float]]:
    """Return ``{module: {stat: value}}``: the parameters' counts of one step pooled per module.

    A share is the module's pooled count over its pooled entries, as each parameter's is: ``<fmt>_<kind>`` over
    the signal entries examined (``sampled_nonzero``), ``zero_frac`` and ``negligible_frac`` over ``numel``.
    ``nonfinite`` and ``numel`` are summed, ``l2`` is the L2 of the L2s, ``absmax`` the max, ``min_nonzero`` the min.

    >>> cols = ["has_grad", "numel", "absmax", "l2"]
    >>> rollup([[1, 6, 2.0, 3.0], [1, 2, 1.0, 4.0], [0, 9, 0.0, 0.0]], cols, ["fc", "fc", "out"])
    {'fc': {'params': 2, 'numel': 8, 'absmax': 2.0, 'l2': 5.0}}
    """
    groups: dict[str, list[Sequence[float]]] = {}
    has_grad = columns.index("has_grad")
    for module, row in zip(modules, rows):
        if row is not None and row[has_grad]:
            groups.setdefault(module, []).append(row)
    return {module: _stats(group, columns, module=True) for module, group in groups.items()}


def _stats(group: list[Sequence[float]], columns: Sequence[str], module: bool) -> dict[str, float]:
    """Pool the rows of one parameter (``module=False``) or of a module's parameters; see `rollup`."""
    col = {name: i for i, name in enumerate(columns)}

    def total(key: str) -> float:
        return sum(row[col[key]] for row in group)

    numel = total("numel")
    out: dict[str, float] = {"params": len(group), "numel": _count(numel)} if module else {}
    l2 = [row[col["l2"]] for row in group]
    out.update(absmax=max(row[col["absmax"]] for row in group),   # a parameter's L2 as written: its square could
               l2=math.sqrt(sum(n * n for n in l2)) if module else l2[0])   # underflow (1e-170) or overflow
    if not all(key in col for key in _COUNTS) or any(math.isnan(row[col["sampled"]]) for row in group):
        return out  # stats="norms": no counts
    signal = total("sampled_nonzero")
    nonfinite = sum(_count(row[col["nonfinite"]]) for row in group)   # the sum of what each parameter shows
    out.update(min_nonzero=min(row[col["min_nonzero"]] for row in group), nonfinite=nonfinite,
               zero_frac=total("zeros") / numel if numel else 0.0,
               **({} if module else {"sampled": _count(total("sampled"))}),
               negligible_frac=total("negligible") / numel if numel else 0.0)
    out.update({key: total(key) / signal if signal else 0.0 for key in columns if key.endswith(SHARES)})
    return out


def _count(value: float) -> float:
    return int(round(value)) if math.isfinite(value) else value


# ---- reading: typed views over the lines of one run ------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """What a step's gradient rows mean: the names of their columns and, per row, its parameter and module."""

    columns: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()

    def fits(self, rows: Sequence[Any]) -> bool:
        """Whether ``rows`` can be attributed: one per parameter, with the columns the statistics need."""
        return bool(rows) and len(rows) == len(self.names) and {"has_grad", "numel", "absmax", "l2"} <= set(
            self.columns)


@dataclass(frozen=True)
class Header:
    """The header line: schema, versions, settings and the parameters whose gradients the rows describe."""

    schema: str | None
    layout: Layout
    dtypes: tuple[str, ...] = ()
    version: str | None = None
    created: str | None = None
    rank: int | None = None
    world_size: int | None = None
    scaler: dict[str, Any] | None = None
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def lacks(self) -> str | None:
        """What a log of an older schema lacks, or None."""
        return OLD_WATCH_SCHEMAS.get(self.schema or "")


@dataclass(frozen=True)
class Gradients:
    """A step's ``gradients`` entry. ``rows`` are the rows that are numbers of the header's width, else None."""

    read: str | None
    loss_scale: float | None
    global_norm: float | None
    pre_clip_norm: float | None
    clipped_scaled: bool
    rows: tuple[tuple[float, ...] | None, ...]
    layout: Layout = Layout()

    def params(self) -> dict[str, dict[str, float]]:
        """Return the per-parameter statistics (`param_stats`); ``{}`` when the rows cannot be attributed."""
        return param_stats(self.rows, self.layout.columns, self.layout.names) if self.layout.fits(self.rows) else {}

    def modules(self) -> dict[str, dict[str, float]]:
        """Return the per-module statistics (`rollup`); ``{}`` when the rows cannot be attributed."""
        return rollup(self.rows, self.layout.columns, self.layout.modules) if self.layout.fits(self.rows) else {}


@dataclass(frozen=True)
class Scale:
    """A step's ``scale`` entry (see `scale_entry`); ``end`` is the step the scale after them applies from."""

    first: int | None
    end: int | None
    scale: float | None
    changes: tuple[tuple[int, float], ...]
    skipped: tuple[int, ...]
    skipped_total: int | None


@dataclass(frozen=True)
class ParamLost:
    """One parameter's lost updates in a step: entries that should have moved, of those lost, and the share.
    An ``ampdoctor.watch/1`` log has the share alone (``moved`` and ``lost`` None)."""

    moved: int | None
    lost: int | None
    fraction: float


@dataclass(frozen=True)
class LostUpdates:
    """A step's ``lost_updates`` entry; ``fraction`` is pooled over the parameters (None: nothing moved, or an
    ``ampdoctor.watch/1`` log, which has no counts to pool)."""

    params: dict[str, ParamLost]
    moved: int | None
    lost: int | None
    fraction: float | None


@dataclass(frozen=True)
class Updates:
    """A step's ``updates`` entry (``updates_entry``)."""

    stepped: int
    expected: int
    moved: int
    nonfinite: tuple[str, ...]
    skipped: bool


@dataclass(frozen=True)
class Loss:
    """A step's ``loss`` entry (``loss_entry``); ``value`` None: not a number in the log."""

    value: float | None
    backwards: int
    dropped: int


@dataclass(frozen=True)
class Activations:
    """What a report shows of a step's ``activations`` entry (``ActivationMonitor.step_record``); ``inputs``: the
    look began at the model's call, with its inputs (False: inside the forward, some outputs unseen; None: a log
    written before this was recorded)."""

    sampled: bool
    max_abs: float | None
    ratio: float | None
    module: str | None
    nonfinite_module: str | None
    inputs: bool | None = None


@dataclass(frozen=True)
class Step:
    """A ``step`` line."""

    step: int
    t: float | None = None
    partial: bool = False
    gradients: Gradients | None = None
    scale: Scale | None = None
    lost: LostUpdates | None = None
    activations: Activations | None = None
    updates: Updates | None = None
    loss: Loss | None = None

    @property
    def skipped(self) -> bool:
        """Whether the GradScaler skipped this very step."""
        return self.scale is not None and self.step in self.scale.skipped


@dataclass(frozen=True)
class End:
    """The ``end`` line of a watch that closed: its step count, summary (``core.records.WatchSummary``; None in a line
    without one) and environment."""

    steps: int | None
    summary: WatchSummary | None
    environment: dict[str, Any]


@dataclass
class Recording:
    """What one run of a flight recorder holds, read through the views above.

    Attributes:
        header: the header line, or None (lines before any header).
        steps: the step lines with an int step, in file order.
        end: the end line, or None (killed, or still running).
        report: the report ``ampdoctor run`` appended (``Report.to_dict()`` output), or None.
        findings: the findings of the lines that carry them (the end line), malformed ones left out.
        notes: what the log lacks (an older schema), in words.
    """

    header: Header | None
    steps: list[Step] = field(default_factory=list)
    end: End | None = None
    report: dict[str, Any] | None = None
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        """Whether the run closed its log (an end or report line)."""
        return self.end is not None or self.report is not None

    @property
    def environment(self) -> dict[str, Any]:
        """The environment the run recorded: the end line's (with device facts), else the header's."""
        return (self.end.environment if self.end else {}) or (self.header.environment if self.header else {})

    def lost_by_param(self) -> dict[str, float]:
        """Return each parameter's share of lost updates over the sampled steps: its counts pooled (the watch
        summary's ``lost_fraction`` per parameter), or for an ``ampdoctor.watch/1`` log the mean of its shares."""
        pooled: dict[str, list[float]] = {}
        for lost in (s.lost for s in self.steps if s.lost is not None):
            for name, p in lost.params.items():
                acc = pooled.setdefault(name, [0.0, 0.0, 0.0, 0.0])  # moved, lost, sum of shares, shares
                acc[0] += p.moved or 0
                acc[1] += p.lost or 0
                acc[2] += p.fraction
                acc[3] += 1
        return {n: a[1] / a[0] if a[0] else a[2] / a[3] for n, a in pooled.items()}

    def lost_fraction(self) -> float | None:
        """Return the share of lost updates pooled over every parameter and sampled step (the watch summary's
        ``lost_fraction``); None without counts."""
        counted = [s.lost for s in self.steps if s.lost is not None and s.lost.moved is not None]
        moved = sum(lost.moved or 0 for lost in counted)
        return sum(lost.lost or 0 for lost in counted) / moved if moved else None


def _header(raw: dict[str, Any]) -> Header:
    params = [_dict(p) for p in _list(raw.get("params"))]
    names = tuple(str(p.get("name", i)) for i, p in enumerate(params))
    layout = Layout(tuple(str(c) for c in _list(raw.get("grad_columns"))), names,
                    tuple(str(p.get("module", p.get("name", "?"))) for p in params))
    scaler = raw.get("scaler")
    return Header(_str(raw.get("schema")), layout, tuple(str(p.get("dtype")) for p in params),
                  _str(raw.get("ampdoctor")), _str(raw.get("created")), _int(raw.get("rank")),
                  _int(raw.get("world_size")), scaler if isinstance(scaler, dict) else None,
                  _dict(raw.get("environment")))


def _gradients(raw: dict[str, Any], layout: Layout) -> Gradients:
    width = len(layout.columns)
    rows = []
    for row in _list(raw.get("rows")) if width else ():  # no layout (a line being written): nothing to attribute
        values = [_num(v) for v in row] if isinstance(row, list) else []
        rows.append(tuple(values) if width and len(values) == width and None not in values else None)
    return Gradients(_str(raw.get("read")), _num(raw.get("loss_scale")), _num(raw.get("global_norm")),
                     _num(raw.get("pre_clip_norm")), raw.get("clipped_scaled") is True, tuple(rows), layout)


def _scale(raw: dict[str, Any]) -> Scale:
    span = [_int(s) for s in _list(raw.get("steps"))]
    changes = tuple((c[0], float(c[1])) for c in _list(raw.get("scale_changes")) if isinstance(c, list)
                    and len(c) == 2 and _int(c[0]) is not None and _num(c[1]) is not None)
    return Scale(span[0] if len(span) == 2 else None, span[1] if len(span) == 2 else None, _num(raw.get("scale")),
                 changes, tuple(s for s in _list(raw.get("skipped")) if _int(s) is not None),
                 _int(raw.get("skipped_total")))


def _lost(raw: dict[str, Any], old: bool) -> LostUpdates | None:
    if old:  # ampdoctor.watch/1: {parameter: share}
        shares = {str(n): _num(v) for n, v in raw.items()}
        params = {n: ParamLost(None, None, v) for n, v in shares.items() if v is not None and 0 <= v <= 1}
        return LostUpdates(params, None, None, None) if params else None
    params = {}
    for name, counts in _dict(raw.get("params")).items():
        moved, lost = _int(_dict(counts).get("moved")), _int(_dict(counts).get("lost"))
        if moved and lost is not None and 0 <= lost <= moved:
            params[str(name)] = ParamLost(moved, lost, lost / moved)
    moved, lost = _int(raw.get("moved")), _int(raw.get("lost"))
    if moved is None or lost is None or not 0 <= lost <= moved:
        return None
    return LostUpdates(params, moved, lost, lost / moved if moved else None)


def _activations(raw: dict[str, Any]) -> Activations:
    forward, headroom = _dict(raw.get("forward")), _dict(raw.get("headroom"))
    inputs = forward.get("inputs")
    return Activations(raw.get("sampled") is True, _num(forward.get("max_abs")), _num(headroom.get("ratio")),
                       _str(headroom.get("module")), _str(forward.get("nonfinite_module")),
                       inputs if isinstance(inputs, bool) else None)


def read_step(line: Mapping[str, Any], layout: Layout = Layout(), old: bool = False) -> Step | None:
    """Return the view of a step line (None without an int ``step``); ``layout`` names its gradient rows, ``old``:
    it is from an ``ampdoctor.watch/1`` log.

    >>> s = read_step({"type": "step", "step": 2, "scale": {"steps": [2, 3], "scale": 512.0, "skipped": [2]}})
    >>> s.skipped, s.scale.scale, s.gradients
    (True, 512.0, None)
    """
    step = _int(line.get("step"))
    if step is None:
        return None
    entries = {key: _dict(line.get(key))
               for key in ("gradients", "scale", "lost_updates", "activations", "updates", "loss")}
    return Step(step, _num(line.get("t")), line.get("partial") is True,
                _gradients(entries["gradients"], layout) if entries["gradients"] else None,
                _scale(entries["scale"]) if entries["scale"] else None,
                _lost(entries["lost_updates"], old) if entries["lost_updates"] else None,
                _activations(entries["activations"]) if entries["activations"] else None,
                _updates(entries["updates"]) if entries["updates"] else None,
                _loss(entries["loss"]) if entries["loss"] else None)


def _updates(raw: dict[str, Any]) -> Updates:
    return Updates(_int(raw.get("stepped")) or 0, _int(raw.get("expected")) or 0, _int(raw.get("moved")) or 0,
                   tuple(str(n) for n in _list(raw.get("nonfinite"))), raw.get("skipped") is True)


def _loss(raw: dict[str, Any]) -> Loss:
    return Loss(_num(raw.get("value")), _int(raw.get("backwards")) or 0, _int(raw.get("dropped")) or 0)


def read_recording(header: Mapping[str, Any] | None, lines: Iterable[Mapping[str, Any]]) -> Recording:
    """Return the views of one run's lines (``ampdoctor.core.records.file.read_runs`` parses the file).

    >>> rec = read_recording({"type": "header", "schema": "ampdoctor.watch/1", "params": [{"name": "w"}]},
    ...                      [{"type": "step", "step": 0, "lost_updates": {"w": 0.75}}, {"type": "end"}])
    >>> rec.ended, rec.lost_by_param(), rec.steps[0].lost.fraction, rec.notes[0][:40]
    (True, {'w': 0.75}, None, 'written by an older ampdoctor (ampdoctor')
    """
    view = None if header is None else _header(dict(header))
    layout, old = (view.layout, view.schema in OLD_WATCH_SCHEMAS) if view is not None else (Layout(), False)
    recording = Recording(view)
    for line in lines:
        kind = line.get("type")
        if kind == "step" and (step := read_step(line, layout, old)) is not None:
            recording.steps.append(step)
        elif kind == "end":
            summary = line.get("summary")
            recording.end = End(_int(line.get("steps")), WatchSummary.from_dict(summary) if isinstance(summary, dict)
                                else None, _dict(line.get("environment")))
        elif kind == "report" and isinstance(line.get("report"), dict):
            recording.report = line["report"]
        for item in _list(line.get("findings")):
            try:
                recording.findings.append(read_finding(item))
            except ValueError:
                pass  # a malformed finding in a log is left out; a report line is read whole
    if view is not None and view.lacks and any(s.lost is not None for s in recording.steps):
        recording.notes.append(f"written by an older ampdoctor ({view.schema}): {view.lacks}")
    return recording
