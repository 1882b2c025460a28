"""The gradient part of a watch: statistics read on the device at the read point, then their record and alarms.

``GradientReader.read`` computes the ``GradStats`` rows of a sampled step on the device (no host sync); the watch
copies ``pending()`` to the host with everything else and hands the values to ``consume()``, which builds the
step line's ``"gradients"`` entry (``ampdoctor.core.records.gradients_entry``). The alarms on it:

* AMP608: some gradient entry is inf/NaN (its tensor's abs-max is not finite), so the global norm is too, and no
  GradScaler skipped the step. A norm whose float32 sum of squares overflowed is not one: ``GradStats`` computes it
  without overflow, and the abs-max says whether an entry is really non-finite. With sharded gradients the
  statistics are merged over the ranks, but each rank steps its own shard: a rank whose own entries were all finite
  took no step on inf/NaN gradients and raises none; the rank whose shard held them does, if nothing skipped its
  step (ranks that decided differently are AMP411's, at the end of the job).
* AMP605: with a GradScaler, at least ``UNDERFLOW_FRACTION`` of a parameter's signal gradient entries would flush
  to 0 in fp16 at the loss scale, or at least ``SUBNORMAL_FRACTION`` are fp16 subnormals (below 2**-14 after
  scaling). Signal: finite entries above 2**-24 times the largest gradient entry (``grad_stats.FLOOR``), what fp32
  resolves; below it an entry is rounding residue (a conv bias before BatchNorm, an attention key bias: 0 by
  construction), and no loss scale could hold it next to the largest entry anyway. So the alarm can only fire while
  the largest scaled entry is below 2**10, where raising the scale (its fix) is possible. Gradients an fp16
  backward computed have already lost the values that rounded to 0 (they are zeros now), so for them the
  subnormal share is the visible edge of the loss.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch

from ampdoctor._torch.distributed import LOCAL, Layout, distributed_world, grad_layout, local_numel
from ampdoctor._torch.sparse import row_sparse
from ampdoctor.core.findings import Severity
from ampdoctor.core.records import (
    Arrival,
    GradientSummary,
    Stats,
    Step,
    gradient_rows,
    gradients_entry,
    param_stats,
    read_step,
    rollup,
)
from ampdoctor.core.words import counted
from ampdoctor.monitor.grad_stats import COL, COLUMNS, GradStats, local_tensor
from ampdoctor.monitor.reduction import ShardReduction

__all__ = ["GradientReader", "UNDERFLOW_FRACTION", "SUBNORMAL_FRACTION", "gradient_alarms", "rows_to_dicts"]

_PARTIAL = ("partial DTensor gradient (a pending sum over ranks): the statistics of a sum are not a function of "
            "each rank's part, so it is left out rather than misreported")
_UNKNOWN = ("DTensor placements {} that ampdoctor cannot merge over the ranks (an entry could be counted twice or "
            "missed), so it is left out rather than misreported")
UNDERFLOW_FRACTION = 0.01
SUBNORMAL_FRACTION = 0.10
NORM_HISTORY = 10_000  # sampled steps whose global norm is kept


class GradientReader:
    """Read the gradient statistics of the watched parameters on a sampled step, and keep their latest values.

    Args:
        params: the parameters whose ``.grad`` is read, in the optimizer's order.
        names: their names, one per parameter.
        stats: ``"norms"``, ``"full"`` or ``"exact"`` (see ``Watch``).
        sample: entries per parameter for the counts (``"full"``).
        layouts: one ``ampdoctor._torch.distributed`` layout per parameter (default: all local). Sharded ones are
            summarised on this rank's shard and merged over their groups by :meth:`finish` (two all-reduces per
            group), which the owner must call on every rank at the end of every sampled step.
        padding: per parameter, the zero entries an engine appended at the end of this rank's flat partition
            (DeepSpeed ZeRO's last rank); they are left out of the statistics.

    >>> w = torch.nn.Parameter(torch.ones(3)); w.grad = torch.full((3,), 2.0)
    >>> reader = GradientReader([w], ["w"], stats="norms", sample=16)
    >>> reader.read(None, scaled=False)
    >>> host = {k: t.reshape(-1).tolist() for k, t in reader.pending().items()}
    >>> round(reader.consume(host, step=0)["global_norm"], 4), reader.norm_history
    (3.4641, [(0, 3.4641016151377544)])
    """

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], *, stats: str, sample: int,
                 layouts: Sequence[Layout] | None = None, padding: Sequence[int] | None = None) -> None:
        self.names = list(names)
        self._params = list(params)
        self._layouts = list(layouts) if layouts is not None else [LOCAL] * len(self._params)
        # an engine's zero padding at the end of this rank's flat partition is left out, like FSDP1's
        self._padding = list(padding) if padding is not None else [0] * len(self._params)
        numels = [local_numel(p) - pad for p, pad in zip(params, self._padding)]
        self._stats = GradStats(numels, sample=None if stats == "exact" else sample, counts=stats != "norms")
        sharded = any(kind == "sharded" for kind, _ in self._layouts) and distributed_world() > 1
        self.reduction = ShardReduction(self._layouts, numels, counts=stats != "norms") if sharded else None
        # parameters whose gradients are left out of the statistics, with why (reported in the summary)
        self.unsummarised: dict[str, str] = {n: _PARTIAL if kind == "partial" else _UNKNOWN.format(*what)
                                             for n, (kind, what) in zip(self.names, self._layouts)
                                             if kind in ("partial", "unknown")}
        self._begun: Any = None  # GradStats.begin of a sampled step, merged over the ranks by finish()
        self._rows_read: set[int] = set()  # rows with a gradient in this step's reads so far
        self._pending: torch.Tensor | None = None
        self._loss_scale: torch.Tensor | None = None  # the loss scale the pending statistics assumed
        self._read = "none"
        self._clip: torch.Tensor | None = None  # [pre-clip norm, 1 if it clipped scaled grads, 1 if a norm came back]
        self._own: torch.Tensor | None = None   # sharded: whether this rank's own entries held an inf/NaN
        self.own_nonfinite: bool | None = None   # ... read with the last consumed step; None: the rows are all its own
        self.last_rows: list[list[float]] = []       # the last consumed step's rows of counts, one per parameter
        self._last: dict[str, dict[str, float]] | None = {}  # their per-parameter statistics, made when asked
        self.last_pre_clip: float | None = None       # the norm the last clip returned, before clipping
        self.last_clipped_scaled = False               # the last step's clip ran on still-scaled gradients
        self.norm_history: list[tuple[int, float]] = []  # (step, global norm) of sampled steps, up to NORM_HISTORY
        self.reads = 0                 # sampled steps consumed
        self.arrived: set[int] = set()  # parameters (by index) that had a gradient on some sampled step
        self._trainable = [bool(p.requires_grad) for p in self._params]
        self.clipped_nothing: list[tuple[int, float]] = []  # (step, global norm): a clip returned 0 over these

    @property
    def last(self) -> dict[str, dict[str, float]]:
        """The per-parameter statistics of the last consumed step, by name (``core.records.param_stats``).

        Made from ``last_rows`` when first read, not at every sampled step: the step's record, its alarms and the
        flight recorder work on the rows (54 dicts of 20 shares cost about 1 ms a step on the bench model)."""
        if self._last is None:
            self._last = param_stats(self.last_rows, COLUMNS, self.names)
        return self._last

    def read(self, scale: torch.Tensor | None, scaled: bool) -> None:
        """Compute this step's statistics on the device; ``scaled``: the gradients still carry ``scale``.

        Only the first read of a gradient in a step counts (two ``scaler.step`` calls would raise anyway). A later
        read in the same step adds the rows it finds that the earlier ones had no gradient for: DeepSpeed steps its
        torch optimizer once per parameter group, and only that group's fp32 partition holds a gradient then.
        """
        earlier = self._pending if self._pending is not None else \
            self._begun.out if self._begun is not None else None
        grads = [None if i in self._rows_read else self._grad(i, p) for i, p in enumerate(self._params)]
        if earlier is not None and all(g is None for g in grads):
            return
        self._rows_read.update(i for i, g in enumerate(grads) if g is not None)   # known on the host: no sync
        if self.reduction is None:
            rows = self._stats.compute(grads, scale, scaled)
            self._pending = rows if earlier is None else _combine(earlier, rows)
        else:  # the counts wait for the merged abs-max: finish() at the end of the step
            begun = self._stats.compute(grads, scale, scaled, defer=True)
            if self._begun is not None:
                begun.out, begun.work = _combine(self._begun.out, begun.out), self._begun.work + begun.work
            self._begun = begun
        if earlier is None:
            self._loss_scale = None if scale is None else scale.detach().reshape(1).clone()
            self._read = "scaled" if scaled else "unscaled"

    def _grad(self, i: int, param: torch.Tensor) -> torch.Tensor | None:
        """Return the gradient the statistics read: an FSDP1 shard without its padding; note what is left out."""
        g = param.grad
        if g is None:
            return None
        layout = grad_layout(g)
        if layout in ("partial", "unknown") or self._layouts[i][0] == "unknown":
            placements = ", ".join(str(p) for p in getattr(g, "placements", ()))
            self.unsummarised.setdefault(self.names[i], _PARTIAL if layout == "partial" else
                                         _UNKNOWN.format(placements))
            return None
        if g.layout != torch.strided and not row_sparse(g):
            self.unsummarised.setdefault(self.names[i], f"sparse gradient ({g.layout}): only dense gradients and "
                                                        "sparse rows (nn.Embedding(sparse=True)) are summarised")
            return None
        if (self._layouts[i][0] == "sharded" or self._padding[i]) and getattr(g, "placements", None) is None \
                and g.dim() == 1 and g.numel() > self._stats.numels[i]:
            return g[:self._stats.numels[i]]  # FSDP1 and DeepSpeed pad the last ranks' flat shards with zeros
        return g

    def finish(self) -> None:
        """Merge a sampled step's sharded rows over the ranks (no-op without sharded parameters).

        Call it on every rank at the end of every sampled step, also when this rank read nothing: it issues the
        same collectives either way, so no rank waits for one that never comes.
        """
        if self.reduction is None:
            return
        begun, self._begun = self._begun, None
        out = None if begun is None else begun.out
        if out is not None:   # before the merge: this rank steps its own entries, whatever the other ranks hold
            self._own = ((out[:, COL["has_grad"]] > 0) & ~torch.isfinite(out[:, COL["absmax"]])).any().reshape(1)
        merged = self.reduction.exchange(out, lambda absmax: self._stats.finish(begun, absmax))
        if merged is not None:
            self._pending = merged

    @property
    def reduces(self) -> bool:
        """Whether sampled steps issue collectives (sharded parameters in a process group of two or more ranks)."""
        return self.reduction is not None

    def note_clip(self, total_norm: Any, scaled: bool) -> None:
        """Keep the norm a clipping call returned (the norm before clipping) and whether it clipped scaled grads.

        Of DTensor gradients (FSDP2, tensor parallelism) ``clip_grad_norm_`` returns a DTensor: a replicated one is
        read locally; a partial one (each rank's part of the norm) is left alone, as reading it would take a
        collective on this rank's initiative (the merged rows still give the global norm)."""
        if isinstance(total_norm, torch.Tensor) and getattr(total_norm, "placements", None) is not None:
            total_norm = local_tensor(total_norm)
        if isinstance(total_norm, torch.Tensor) and total_norm.numel() == 1:
            flags = torch.tensor([float(scaled), 1.0], device=total_norm.device)   # scaled, a norm was returned
            self._clip = torch.cat([total_norm.detach().reshape(1).float(), flags])
        elif scaled:   # clip_grad_value_ returns nothing: only that it clipped still-scaled gradients
            self._clip = torch.tensor([0.0, 1.0, 0.0])

    def pending(self) -> dict[str, torch.Tensor]:
        """Return the device values read since the last ``consume()``: ``rows``, ``scale``, ``clip`` (``{}``)."""
        if self._pending is None:
            return {}
        out = {"rows": self._pending}
        if self._loss_scale is not None:
            out["scale"] = self._loss_scale
        if self._clip is not None:
            out["clip"] = self._clip
        if self._own is not None:
            out["own"] = self._own
        return out

    def clear(self) -> None:
        """Drop what was read and not consumed."""
        self._pending = self._loss_scale = self._clip = self._begun = self._own = None
        self._rows_read = set()

    def release(self) -> None:
        """Drop the references to the parameters and to pending values; the results stay."""
        self._params = []
        self.clear()

    def summary(self, modules: Sequence[str], trained: Sequence[bool] | None = None) -> GradientSummary:
        """Return the gradients' section of the summary: the last step's statistics by parameter and by module
        (``modules``: the module of each parameter; pooled by ``core.records.rollup``), the norms, and which trainable
        tensors got a gradient (``arrival``) among those ``trained`` marks as part of what the run trains (default:
        all); the others that never got one are counted as ``outside``."""
        trained = [True] * len(self.names) if trained is None else trained
        counted = [k for k, t in enumerate(self._trainable) if t and trained[k]]
        arrival = Arrival(self.reads, len(counted), tuple(self.names[k] for k in counted if k not in self.arrived
                                                          and self.names[k] not in self.unsummarised),
                          # in the optimizer, in no model the run trains, and never with a gradient
                          sum(1 for k, t in enumerate(self._trainable) if t and not trained[k]))
        last = self.norm_history[-1] if self.norm_history else None
        peak = max(self.norm_history, key=lambda sn: sn[1] if math.isfinite(sn[1]) else -1.0) if last else None
        merged = None if self.reduction is None else (len(self.reduction.rows), self.reduction.collectives)
        return GradientSummary(
            {n: Stats.from_dict(s) for n, s in self.last.items()},
            {m: Stats.from_dict(s) for m, s in rollup(self.last_rows, COLUMNS, modules).items()}, arrival,
            None if last is None else last[0], None if last is None else last[1], peak, dict(self.unsummarised),
            merged, tuple(self.clipped_nothing), self.last_pre_clip, self.last_clipped_scaled)

    def consume(self, values: dict[str, list[float]], step: int) -> dict[str, Any]:
        """Take the host copy of ``pending()``; return the step line's ``"gradients"`` entry."""
        rows = gradient_rows(values["rows"], len(COLUMNS))
        scale = values.get("scale")
        entry = gradients_entry(rows, COLUMNS, read=self._read, loss_scale=scale[0] if scale else None,
                                clip=values.get("clip"))
        self.last_rows, self._last = rows, None  # the per-parameter dicts are made when read (``last``)
        own = values.get("own")
        self.own_nonfinite = bool(own[0]) if own else None
        read = read_step({"step": step, "gradients": entry}).gradients
        self.last_pre_clip, self.last_clipped_scaled = read.pre_clip_norm, read.clipped_scaled
        self.reads += 1
        self.arrived.update(k for k, row in enumerate(rows) if row and row[COL["has_grad"]] > 0)
        if read.pre_clip_norm == 0 and read.global_norm and read.global_norm > 0 and len(self.clipped_nothing) < 100:
            self.clipped_nothing.append((step, read.global_norm))   # a clip over no parameters, or other ones
        if read.global_norm is not None and len(self.norm_history) < NORM_HISTORY:
            self.norm_history.append((step, read.global_norm))
        return entry


def _combine(earlier: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """Return the rows of ``earlier``, with those it had no gradient for taken from ``later``."""
    return torch.where(later[:, COL["has_grad"]:COL["has_grad"] + 1] > 0, later, earlier)


def gradient_alarms(record: Step, rows: Sequence[Sequence[float] | None], names: Sequence[str], *, scaler: bool,
                    stats: str, skips_known: bool = True,
                    own_nonfinite: bool | None = None) -> Iterator[tuple[str, Severity, str, str]]:
    """Yield ``(code, severity, where, detail)`` for the alarms a step line raises (AMP608, AMP605).

    Args:
        record: the step line (``core.records.read_step``), with its gradients and, if any, its scale entry.
        rows: that step's host rows of ``COLUMNS``, one per parameter (``None``: not read).
        names: the parameters' names, one per row.
        scaler: whether the watch has a GradScaler (AMP605 is about the loss scale).
        stats: the watch's statistics level; ``"norms"`` has no counts, so no AMP605.
        skips_known: whether a skipped step would be in the record (False: the GradScaler's part of the watch is
            off after an internal error, and "not skipped" cannot be said: no AMP608).
        own_nonfinite: with rows merged over the ranks (sharded gradients), whether this rank's own entries held an
            inf/NaN; False: this rank's step took finite gradients, no AMP608 here. None: the rows are its own.

    The rows are read column by column, without the per-parameter dicts of ``param_stats`` (made only for a
    parameter that raises AMP605): this runs at every sampled step.
    """
    grads, step = record.gradients, record.step
    if grads is None or grads.global_norm is None:
        return
    present = [(n, row) for n, row in zip(names, rows) if row is not None and row[COL["has_grad"]]]
    absmax = COL["absmax"]
    bad = [n for n, row in present if not math.isfinite(row[absmax])]  # abs-max is inf/NaN iff an entry is
    if not math.isfinite(grads.global_norm) and bad and not record.skipped and skips_known \
            and own_nonfinite is not False:
        yield ("AMP608", Severity.WARNING, ", ".join(bad[:3]) + (" …" if len(bad) > 3 else ""),
               f"global gradient norm {grads.global_norm} at step {step} and the step was not skipped "
               f"(no GradScaler skipped it); {counted(len(bad), 'parameter')} with non-finite gradients")
    if not scaler or stats == "norms" or grads.clipped_scaled:
        return  # clipping the still-scaled gradients shrank them by the scale: their underflow is an artefact
    flagged = []
    for name, row in present:  # the shares of param_stats: a count over the signal entries examined, 0 without
        signal = row[COL["sampled_nonzero"]]
        if math.isnan(row[COL["sampled"]]) or not signal:
            continue
        under, subnormal = row[COL["fp16_underflow"]] / signal, row[COL["fp16_subnormal"]] / signal
        if under >= UNDERFLOW_FRACTION or subnormal >= SUBNORMAL_FRACTION:
            flagged.append((under, subnormal, name, row))
    top = max((row[absmax] for _, row in present if math.isfinite(row[absmax])), default=0.0)
    for under, subnormal, name, row in sorted(flagged, key=lambda f: f[:3], reverse=True)[:5]:
        detail = _underflow_detail(param_stats([row], COLUMNS, [name])[name], under, subnormal, grads.loss_scale, top)
        yield "AMP605", Severity.WARNING, name, detail


def _underflow_detail(stats: dict[str, float], under: float, subnormal: float, scale: float | None,
                      top: float) -> str:
    """Describe AMP605 by the criterion that fired, with the headroom the loss scale has left."""
    shown = "?" if scale is None else f"{scale:g}"
    signal = (f"of the gradient entries that fp32 resolves (non-zero and above 2**-24 x the largest gradient entry "
              f"{top:.3g})")
    if under >= UNDERFLOW_FRACTION:
        text = (f"{under:.1%} {signal} would round to 0 in fp16 at loss scale {shown} (below 2**-25 after scaling; "
                f"{subnormal:.1%} are fp16 subnormals)")
    else:
        text = (f"{subnormal:.1%} {signal} are fp16 subnormals at loss scale {shown} (below 2**-14 ≈ 6.1e-5 after "
                f"scaling: fewer significant bits, and the smaller ones round to 0; {stats['zero_frac']:.1%} of "
                f"the entries are 0)")
    if scale is not None and 0 < top * scale < 65504 / 2:  # always so when the alarm fires (module docstring)
        text += (f"; the largest scaled gradient entry is {top * scale:.3g}, {65504 / (top * scale):.3g}x below "
                 f"fp16's max 65504, so the scale has room to grow")
    return text


def rows_to_dicts(matrix: Sequence[Sequence[float]], names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Turn host rows of ``GradStats.compute`` into ``{name: {stat: value}}`` (``core.records.param_stats``).

    >>> rows_to_dicts([[1, 4, 3.0, 0.5, 3.1, 0, 1, 0, 4, 3, 1] + [0] * 11], ["w"])["w"]["fp16_underflow"]
    0.3333333333333333
    """
    return param_stats(matrix, COLUMNS, names)
