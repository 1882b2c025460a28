"""Merge the gradient statistics of sharded parameters over the ranks that hold their shards.

Under FSDP2 (``fully_shard``), tensor parallelism and sharded FSDP1, each rank holds a shard of a gradient, and
``GradStats`` summarises that shard. A sampled step merges the rows of those parameters with two all-reduces per
process group, whatever the number of parameters:

1. MAX over ``[abs-max, has-NaN, has-grad, -smallest non-zero |g|]`` per row (the minimum as a negated maximum), before
   the counts: the fp8 counts scale by the tensor's abs-max and the negligible floor is relative to the largest
   entry, so both must be the merged ones for the counts to equal a single-process computation;
2. SUM over ``[numel, L2², counts...]`` per row, after them.

NaN is never sent through a MAX (backends differ on it): it travels as a flag. Rows without a gradient on a rank
(an empty shard) contribute the identity (-inf, 0). A parameter sharded over two mesh dimensions is merged over
each dimension's group in turn (SUM and MAX are associative). Replicated gradients (DDP, ``Replicate`` DTensors)
are not merged: every rank holds the same whole value.

Collectives. The same collectives, in the same order, on every rank: the groups are listed in the order of the
parameters, which is the same on every rank, and the watch calls ``exchange`` at the end of every sampled step
(an optimizer-step counter, never a hook whose firing can differ by rank), with identity rows when this rank read
nothing (its gradient part failed). Tensors go on the device of each group's backend: CPU for gloo, CUDA for NCCL.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ampdoctor._torch.distributed import Layout, reduction_device
from ampdoctor.monitor.grad_stats import COL, COLUMNS

__all__ = ["ShardReduction", "MAX_COLUMNS", "SUM_COLUMNS"]

MAX_COLUMNS = ("absmax", "nan", "has_grad", "min_nonzero")  # min_nonzero travels negated
SUM_COLUMNS = ("numel", "l2", *COLUMNS[COL["nonfinite"]:])  # l2 travels squared
_COUNTS = slice(COL["nonfinite"], len(COLUMNS))


class ShardReduction:
    """Merge ``GradStats`` rows over the process groups of sharded parameters.

    Args:
        layouts: one ``ampdoctor._torch.distributed`` layout per row; rows of kind ``"sharded"`` are merged over
            their groups, the others are left as they are.
        numels: the local number of entries of each row (the identity rows of a rank that read nothing).
        counts: whether the rows carry counts (``stats != "norms"``); without them the count columns stay NaN.
    """

    def __init__(self, layouts: Sequence[Layout], numels: Sequence[int], *, counts: bool) -> None:
        self.numels, self.counts = [int(n) for n in numels], counts
        order: dict[int, tuple[Any, list[int]]] = {}
        for row, (kind, groups) in enumerate(layouts):
            if kind != "sharded":
                continue
            for group in groups:
                order.setdefault(id(group), (group, []))[1].append(row)
        self.groups: list[tuple[Any, tuple[int, ...]]] = [(g, tuple(rows)) for g, rows in order.values()]
        self.rows = sorted({r for _, rows in self.groups for r in rows})
        self.collectives = 0  # all-reduces issued so far
        self.bytes = 0  # bytes sent into them (per rank, before the backend's own traffic)
        self._index: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    def identity(self, device: torch.device | None = None) -> torch.Tensor:
        """Return the rows of a rank that read no gradient: no gradient anywhere, the local numels."""
        out = torch.full((len(self.numels), len(COLUMNS)), math.nan, dtype=torch.float64, device=device)
        out[:, COL["has_grad"]] = 0.0
        out[:, COL["numel"]] = torch.tensor(self.numels, dtype=torch.float64)
        return out

    def exchange(self, out: torch.Tensor | None,
                 finish: Callable[[torch.Tensor], torch.Tensor | None]) -> torch.Tensor | None:
        """Merge ``out`` (this rank's rows after ``GradStats.begin``, or None) and return the merged rows.

        ``finish(absmax)`` computes the counts with the merged abs-max column and returns the finished local rows;
        an exception in it is raised only after the second collective, so every rank still issues both.
        """
        local = self.identity() if out is None else out
        maxed = self._max(local)
        error: BaseException | None = None
        finished = local
        if out is not None:
            try:
                done = finish(maxed[:, COL["absmax"]])
                finished = local if done is None else done
            except Exception as exc:  # join the SUM with identity rows, then report
                error, finished = exc, self.identity(local.device)
        summed = self._sum(finished if error is None else self.identity(local.device))
        if error is not None:
            raise error
        if out is None:
            return None
        rows = self._index_of(tuple(self.rows), finished.device)
        merged = finished.clone()
        for name in ("has_grad", "absmax", "min_nonzero", "numel", "l2"):
            source = maxed if name in ("has_grad", "absmax", "min_nonzero") else summed
            merged[rows, COL[name]] = source.index_select(0, rows)[:, COL[name]]
        merged[rows, _COUNTS] = summed.index_select(0, rows)[:, _COUNTS]
        # a NaN entry anywhere: the L2 is NaN too (the SUM carried 0 for it); no gradient anywhere: nothing known
        sub = merged.index_select(0, rows)
        none = sub[:, COL["has_grad"]] == 0
        sub[:, COL["l2"]] = torch.where(sub[:, COL["absmax"]].isnan(), math.nan, sub[:, COL["l2"]])
        sub[:, COL["absmax"]:] = torch.where(none[:, None], math.nan, sub[:, COL["absmax"]:])
        merged[rows] = sub
        return merged

    # ---- the two collectives -----------------------------------------------------------------------------------
    # Each builds the values it sends for every row once, from this rank's own rows, and then reduces them group by
    # group in place: a row sharded over two mesh dimensions is reduced over the second group with what the first
    # one merged. Masking per group from the local rows instead would drop the first merge on a rank whose own
    # shard is empty (FSDP2 leaves some ranks without rows of a small tensor-parallel weight).
    def _max(self, out: torch.Tensor) -> torch.Tensor:
        has = out[:, COL["has_grad"]] > 0
        absmax, smallest = out[:, COL["absmax"]], out[:, COL["min_nonzero"]]
        block = self._reduce(torch.stack([
            torch.where(has & ~absmax.isnan(), absmax, -math.inf),
            (has & absmax.isnan()).double(),
            has.double(),
            torch.where(has & ~smallest.isnan(), -smallest, -math.inf)], 1), "MAX")
        result = out.clone()
        has = block[:, 2] > 0
        result[:, COL["has_grad"]] = block[:, 2]
        result[:, COL["absmax"]] = torch.where(has & (block[:, 1] == 0), block[:, 0], math.nan)
        result[:, COL["min_nonzero"]] = torch.where(has, -block[:, 3], math.nan) if self.counts else math.nan
        return result

    def _sum(self, out: torch.Tensor) -> torch.Tensor:
        has = (out[:, COL["has_grad"]] > 0)[:, None]
        values = torch.cat([out[:, COL["numel"]:COL["numel"] + 1], out[:, COL["l2"]:COL["l2"] + 1].square(),
                            out[:, _COUNTS]], 1)
        values[:, 1:] = torch.where(has & ~values[:, 1:].isnan(), values[:, 1:], 0.0)
        block = self._reduce(values, "SUM")
        result = out.clone()
        result[:, COL["numel"]] = block[:, 0]
        result[:, COL["l2"]] = block[:, 1].sqrt()
        result[:, _COUNTS] = block[:, 2:] if self.counts else math.nan
        return result

    def _reduce(self, block: torch.Tensor, op: str) -> torch.Tensor:
        """All-reduce the rows of ``block`` over their groups in turn (one collective per group); rows outside
        every group come back as they went (the caller keeps only the merged rows)."""
        for group, rows in self.groups:
            index = self._index_of(rows, block.device)
            block[index] = self._all_reduce(block.index_select(0, index), group, op).to(block.device)
        return block

    def _all_reduce(self, block: torch.Tensor, group: Any, op: str) -> torch.Tensor:
        import torch.distributed as dist

        block = block.to(reduction_device(group)).contiguous()
        dist.all_reduce(block, op=getattr(dist.ReduceOp, op), group=group)
        self.collectives += 1
        self.bytes += block.numel() * block.element_size()
        return block

    def _index_of(self, rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
        index = self._index.get((rows, device))
        if index is None:
            index = self._index[(rows, device)] = torch.tensor(rows, dtype=torch.long, device=device)
        return index
