"""Batched per-parameter gradient statistics, computed on the device into one tensor, with no host sync.

``GradStats.compute`` returns a ``[n_params, len(COLUMNS)]`` float64 tensor on the gradients' device. Reading it
(``.tolist()``) is the only host sync, and the caller decides when that happens.

The statistics are always of the *unscaled* gradient. When the grads still carry the loss scale ``S`` (GradScaler
stage READY, or a fused optimizer that unscales inside its kernel) magnitudes are multiplied by ``1/S``. fp16 and
bf16 casts are simulated at ``|g_unscaled| * S``, the value the format holds under the loss scale. e4m3 and e5m2
casts are simulated at ``|g| * fp8_max / amax`` with the tensor's own abs-max: per-tensor current scaling, as in
TransformerEngine and torchao's float8 tensorwise (delayed scaling takes the amax of a history, at least as large,
so it underflows at least as much). The largest entry lands on fp8_max (448, 57344): no tensor overflows its own
cast, the fp8 overflow counts are 0 by construction and underflow is what matters. A tensor with inf/NaN has no
usable amax: ``fp8_max / inf`` turns every finite entry into 0, counted as underflow.

The format counts are over the *signal*: finite entries above ``floor`` (2**-24) times the largest finite |g| of
the call. fp32 carries 24 significant bits: a smaller entry is at the rounding level of an fp32 computation of
that size, not a value that fp32 would have kept (the gradient of a conv bias before BatchNorm, or of an
attention key bias, is 0 mathematically and comes out at 1e-9 to 1e-7 of the largest entry). And since the
GradScaler keeps ``amax * S`` below 65504, a signal entry can be an fp16 subnormal only while ``amax * S < 2**10``
(2**-14 / 2**-24): while the scale could still grow 64-fold.

Cost. A pass over the gradients of a 10M-parameter model takes a few ms on 2 CPU cores, a fresh buffer of that
size costs page faults on top, and every torch call has a fixed cost (more when other processes keep the second
core busy and a parallel call waits for its thread). So the work is split in two:

* over *all* entries, two reading passes and no large allocation: the L2 norm (BLAS ``torch.dot(g, g)``, or
  ``torch._foreach_norm`` for half-precision grads) and the abs-max (``torch.aminmax`` per tensor). abs-max is
  inf/NaN exactly when some entry is, and it proves a count of overflows to be exactly 0 when even the largest
  entry does not overflow. The float32 sum of squares overflows above a stored norm of 2**64 ≈ 1.8e19 (a loss
  scale of 2**60 on gradients of 10) with every entry finite: such a row takes its L2 from the examined entries
  divided by the abs-max before squaring (exact when the parameter is examined whole, else sample-estimated);
* over a fixed sample of up to ``sample`` entries per parameter, gathered into one vector and counted with one
  histogram per parameter (a constant number of torch calls): zeros, non-finite entries, the smallest non-zero
  |g|, and the simulated underflow, overflow and subnormal counts. A parameter with at most ``sample`` entries is
  examined whole, so its counts are exact; for a larger one the fractions are unbiased estimates (±1.6% at 95% for
  4096 entries) and the smallest non-zero |g| is the smallest *examined*, an upper bound. ``sample=None`` examines
  every entry of every parameter (slow on big models; for audits and tests).

Rows that carry gradient. A larger parameter with two or more dimensions (an embedding, whose gradient is non-zero
only in the rows of the batch's tokens) is examined by rows (``ampdoctor.monitor.grad_rows``): its per-row L2 norms
take the place of its dot (still one reading pass on CPU; one more pass on an accelerator, where the foreach norms
stay), the sample is drawn among its touched rows (about 40 ATen ops more per group, whatever its size, and no
host sync), its format shares are those of the touched rows, and its zeros, negligible and non-finite counts are
scaled up from the touched rows, the untouched rows' entries counted as zeros. A dense gradient examines the same
entries as a uniform sample. A sparse COO gradient (``nn.Embedding(sparse=True)``) is examined over the rows it
stores, or densified when it has at most ``sample`` entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ampdoctor._torch import foreach
from ampdoctor._torch.distributed import grad_layout
from ampdoctor._torch.sparse import densified, row_sparse, stored_rows
from ampdoctor.core.formats import FORMATS, LOSS_SCALED, FloatFormat
from ampdoctor.monitor.grad_counts import Plan, bins_per_row, count_sample, limits
from ampdoctor.monitor.grad_rows import pick_rows, row_draws, rows_of

__all__ = ["FloatFormat", "FORMATS", "LOSS_SCALED", "FLOOR", "KINDS", "COLUMNS", "COL", "GradStats",
           "sample_index", "Begun", "Work", "local_tensor"]


FLOOR = 2.0**-24  # negligible below this times the largest finite |g| (fp32's 24 significant bits)

# One row per parameter. absmax and l2 are over all entries. min_nonzero is over the examined entries; zeros,
# negligible (finite, non-zero, at most the floor) and nonfinite are counts scaled up from them (exact when
# sampled == numel; nonfinite is exactly 0 when absmax is finite, and at least 1 when it is not): from the entries of
# the touched rows for a parameter examined by rows, plus the untouched rows' entries as zeros.
# sampled_nonzero counts the examined signal entries (finite, above the floor); <fmt>_underflow/_overflow/_subnormal
# count entries among them; _subnormal (below the smallest normal after scaling) includes those that underflow.
KINDS = ("underflow", "overflow", "subnormal")
COLUMNS: tuple[str, ...] = (
    "has_grad", "numel", "absmax", "min_nonzero", "l2", "nonfinite", "zeros", "negligible", "sampled",
    "sampled_nonzero",
    *(f"{f.name}_{kind}" for kind in KINDS for f in FORMATS),
)
COL = {name: i for i, name in enumerate(COLUMNS)}

_NATIVE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
Kind = tuple[int, int] | int | None  # how a member is examined: (rows, cols) by rows, cols (sparse) by stored rows


class GradStats:
    """Compute the statistics of ``COLUMNS`` for a fixed list of parameters.

    Args:
        numels: the number of entries of each parameter, in the order of the rows.
        sample: entries per parameter examined for the counts; ``None`` examines all of them.
        seed: seed of the private generator that picks the sampled entries (the global RNG is never touched).
        counts: compute the count columns; ``False`` leaves them NaN and computes only the extremes.
        floor: entries at most ``floor`` times the largest finite |g| of the call are negligible, left out of the
            format counts (see the module docstring); 0 counts every finite non-zero entry.

    >>> g = torch.tensor([0.0, 2.0**-26, 2.0**-20])
    >>> row = GradStats([3]).compute([g]).tolist()[0]
    >>> row[COL["zeros"]], row[COL["fp16_underflow"]], row[COL["min_nonzero"]] == 2**-26
    (1.0, 1.0, True)
    """

    def __init__(self, numels: Sequence[int], *, sample: int | None = 4096, seed: int = 0,
                 counts: bool = True, floor: float = FLOOR) -> None:
        if sample is not None and (not isinstance(sample, int) or sample < 1):
            raise ValueError(f"sample must be a positive number of entries or None, got {sample!r}")
        if not 0.0 <= floor < 1.0:
            raise ValueError(f"floor must be a fraction of the largest |g| in [0, 1), got {floor!r}")
        self.numels = [int(n) for n in numels]
        self.sample, self.counts, self.floor, self._seed = sample, counts, floor, seed
        self._gather: dict[tuple[tuple[int, ...], torch.device, tuple[Kind, ...]], Plan] = {}  # built once
        self._constants: dict[tuple[object, torch.device], torch.Tensor] = {}

    def _constant(self, key: tuple[object, ...], device: torch.device, values: Sequence[float],
                  dtype: torch.dtype) -> torch.Tensor:
        # Built once per device: a host-to-device copy of pageable memory would wait for the device.
        cached = self._constants.get((key, device))
        if cached is None:
            cached = self._constants[(key, device)] = torch.tensor(list(values), dtype=dtype, device=device)
        return cached

    def compute(self, grads: Sequence[torch.Tensor | None], scale: torch.Tensor | float | None = None,
                scaled: bool = False, *, defer: bool = False) -> Any:
        """Return the ``[len(grads), len(COLUMNS)]`` float64 statistics on the grads' device, without a host sync.

        Args:
            grads: one gradient (or ``None``) per parameter given at construction. A sparse COO gradient counts when
                it is sparse in its first dimension only (``nn.Embedding(sparse=True)``), other sparse layouts are
                skipped. A sharded DTensor counts by its local shard (numels given at construction are then local
                numels).
            scale: the loss scale ``S`` of this backward (a 0-dim tensor or a number); ``None`` means 1.
            scaled: whether ``grads`` still carry ``S`` (GradScaler stage READY) or are already unscaled.
            defer: return a :class:`Begun` instead (extremes done, the examined entries copied, counts left to
                :meth:`finish`): a sharded gradient's counts need the abs-max merged over every rank first.
        """
        begun = self.begin(grads, scale, scaled, keep=defer)
        return begun if defer else self.finish(begun)

    def begin(self, grads: Sequence[torch.Tensor | None], scale: torch.Tensor | float | None = None,
              scaled: bool = False, keep: bool = True) -> Begun:
        """Compute the extremes (abs-max, L2) of every gradient; with ``keep``, copy the examined entries too."""
        if len(grads) != len(self.numels):
            raise ValueError(f"expected {len(self.numels)} gradients (one per parameter), got {len(grads)}")
        grads = [local_tensor(g) for g in grads]
        present = [(i, g) for i, g in enumerate(grads) if g is not None and g.numel() and
                   g.numel() == self.numels[i] and (g.layout == torch.strided or row_sparse(g))]
        # collect on an accelerator when any gradient is on one: every copy is then host-to-device or
        # device-to-device, ordered on the streams; a non_blocking device-to-host copy would be read unsynchronised
        device = next((g.device for _, g in present if g.device.type != "cpu"),
                      present[0][1].device if present else torch.device("cpu"))
        out = torch.full((len(grads), len(COLUMNS)), math.nan, dtype=torch.float64, device=device)
        out[:, COL["has_grad"]] = 0.0
        out[:, COL["numel"]] = self._constant(("numels",), device, self.numels, torch.float64)
        begun = Begun(out, [], None, None)
        if not present:
            return begun
        with torch.no_grad():
            s = torch.ones((), dtype=torch.float32, device=device) if scale is None else \
                torch.as_tensor(scale, dtype=torch.float32).to(device, non_blocking=True)
            # Unscale like GradScaler.unscale_ (reciprocal in float64). Simulate |g_unscaled| * S.
            begun.unscale = s.double().reciprocal() if scaled else torch.ones((), dtype=torch.float64, device=device)
            begun.simulate = torch.ones((), dtype=torch.float32, device=device) if scaled else s
            groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
            for i, g in present:
                groups.setdefault((g.device, g.dtype), []).append((i, g))
            for (gdev, dtype), items in groups.items():
                kinds = tuple(self._kind(g) for _, g in items)
                # a sparse gradient: the rows it stores, or the whole tensor when it is examined whole
                gs = [g if g.layout == torch.strided else densified(g) if kind is None else stored_rows(g)
                      for (_, g), kind in zip(items, kinds)]
                # complex: the magnitudes |g| (same L2 and abs-max; g.float() would drop the imaginary part, warning)
                gs = [g.abs() if g.is_complex() else g if dtype in _NATIVE else g.float() for g in gs]
                rows = tuple(i for i, _ in items)
                plan = self._plan(rows, gdev, kinds)
                absmax, l2, values, picks, covered = self._extremes(rows, gs, plan)
                if values is None and keep:
                    values = self._values(gs, plan, picks)
                begun.work.append(Work(rows, plan, gs if values is None else None, values, absmax, l2, picks, covered))
                index = self._constant(("rows", rows), device, rows, torch.long)
                out[:, COL["has_grad"]].index_fill_(0, index, 1.0)  # a scalar index_put_ copies it to the device
                if keep:  # finish() writes them at once otherwise; the ranks' merge reads them first
                    out[index, COL["absmax"]] = absmax.to(device, non_blocking=True) * begun.unscale
                    out[index, COL["l2"]] = l2.to(device, non_blocking=True) * begun.unscale
                if keep and self.counts:  # the smallest non-zero |g| examined: merged over ranks before the counts
                    a = values.abs().float()
                    small = torch.full((len(rows),), math.inf, dtype=torch.float32, device=gdev).scatter_reduce_(
                        0, plan.segment, torch.where(torch.isfinite(a) & (a > 0), a, math.inf), "amin")
                    out[index, COL["min_nonzero"]] = small.double().to(device, non_blocking=True) * begun.unscale
        return begun

    def finish(self, begun: Begun, absmax: torch.Tensor | None = None) -> torch.Tensor:
        """Return the statistics of :meth:`begin`, counting with ``absmax`` (``[P]`` float64, unscaled: the abs-max
        merged over the ranks that share each parameter) for the fp8 scaling and the floor, else the local one."""
        out = begun.out
        if not begun.work:
            return out
        device, unscale = out.device, begun.unscale
        with torch.no_grad():
            merged = [(absmax.index_select(0, self._constant(("rows", w.rows), device, w.rows, torch.long)) / unscale)
                      if absmax is not None else w.absmax for w in begun.work]
            # the floor, in stored units: a fraction of the largest finite |g| of every group
            top = torch.stack([torch.where(torch.isfinite(a), a, 0.0).max().to(device) for a in merged])
            floor = (top.max() * self.floor).float()
            for w, amax in zip(begun.work, merged):
                rows, values, local, l2 = w.rows, w.values, w.absmax, w.l2
                gdev = local.device
                amax = amax.to(gdev, non_blocking=True)
                # On CPU reading a flag costs nothing: the squares, which only replace an overflowed float32 L2, are
                # summed only then, and the non-finite code only when an abs-max says there is one.
                cpu = gdev.type == "cpu"
                squares = bool(torch.isinf(l2).any()) if cpu else True
                if values is None and (self.counts or squares):
                    values = self._values(w.grads, w.plan, w.picks)
                if self.counts:
                    finite = bool(torch.isfinite(local).all()) if cpu else False
                    counts = self._counts(w, values, begun.simulate.to(gdev, non_blocking=True),
                                          floor.to(gdev, non_blocking=True), amax, squares, finite)
                    min_nonzero, sumsq, counts = counts[:, -2], counts[:, -1], counts[:, :-2]
                    unit = torch.where(torch.isfinite(amax), amax, local)  # what count_sample divided by
                else:
                    counts = torch.full((len(rows), len(COLUMNS) - 5), math.nan, dtype=torch.float64, device=gdev)
                    min_nonzero = torch.full_like(local, math.nan)
                    sumsq = self._sum_squares(w, values) if squares else None
                    unit = local
                if squares:  # float32 squares overflowed though every entry is finite: L2 = abs-max * |g / abs-max|
                    l2 = torch.where(torch.isinf(l2) & torch.isfinite(local), unit * sumsq.sqrt(), l2)
                block = torch.cat([torch.stack([local, min_nonzero, l2], 1).to(device, non_blocking=True),
                                   counts.to(device, non_blocking=True)], 1)
                block[:, 0:3] *= unscale
                index = self._constant(("rows", rows), device, rows, torch.long)
                out[index, COL["absmax"]:] = block
        return out

    def _kind(self, g: torch.Tensor) -> Kind:
        """Return how ``g`` is examined: whole or by a fixed sample (None), by rows (``(rows, cols)``), by the rows
        a sparse gradient stores (``cols``). Only the counts need rows: without them a dense gradient keeps its
        fixed sample (its L2 estimate, when the float32 squares overflow, is unbiased either way)."""
        n = g.numel()
        if self.sample is None or n <= self.sample or g.dim() < 2 or g.shape[0] < 2:
            return None
        if g.layout != torch.strided:
            return n // g.shape[0]
        # a view as [rows, cols] without a copy: any 2-D tensor, or a contiguous one
        return (g.shape[0], n // g.shape[0]) if self.counts and (g.dim() == 2 or g.is_contiguous()) else None

    def _extremes(self, rows: tuple[int, ...], gs: list[torch.Tensor], plan: Plan
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[torch.Tensor | None],
                             torch.Tensor | None]:
        """Return float64 abs-max (NaN if any NaN) and L2 norm per gradient, over all entries, in stored units; on
        CPU the examined entries in ``plan`` order (else None: ``_values`` gathers them); the indices of the
        examined entries per gradient (None: all) and how many entries they stand for (``_rows``).

        On CPU, a gradient examined whole is read once, into the examined entries, and its abs-max and L2 are
        segment reductions over them; a larger one gets two reading passes of its own and no allocation the size
        of the gradient (a fresh buffer of that size costs page faults on every step, which made an abs() copy
        slower than the reductions themselves): the abs-max, and the sum of squares (one dot), or for one examined
        by rows the L2 of every row, whose L2 is the tensor's. Its L2 is inf when a float32 sum of squares
        overflows; ``finish`` replaces it.
        """
        if gs[0].device.type != "cpu" or gs[0].dtype.itemsize < 4 or not all(g.is_contiguous() for g in gs):
            return self._foreach_extremes(rows, gs, plan)
        dots, lo_hi, picked, norms = self._passes(gs, plan)
        absmax = torch.zeros(len(gs), dtype=torch.float64)
        l2 = torch.zeros(len(gs), dtype=torch.float64)
        if lo_hi:  # max(|min|, |max|): NaN propagates through abs and amax
            top = torch.stack([x for pair in lo_hi for x in pair]).view(-1, 2).abs().amax(1)
            absmax.index_copy_(0, plan.sampled, top.double())
        if dots:  # the members with a fixed sample come first in plan.sampled
            l2.index_copy_(0, plan.sampled[:len(dots)] if plan.rowed else plan.sampled,
                           torch.stack(dots).double().sqrt())
        picks, covered, rows_l2 = self._rows(rows, plan, norms, absmax)
        if rows_l2 is not None:
            l2.index_copy_(0, plan.rowed_index, rows_l2)
        if rows_l2 is not None and self.counts:  # in the order of by_rows, which is the concatenation order
            picked += [gs[k].reshape(-1).index_select(0, picks[k]) for r, _ in plan.by_rows for k in r.members]
        values = torch.cat(picked) if picked else None
        if plan.whole:  # float64 squares: no overflow, and NaN and inf propagate as in a dot
            whole, segment = values[:plan.whole].double(), plan.segment[:plan.whole]
            absmax.scatter_reduce_(0, segment, whole.abs(), "amax")
            l2.index_add_(0, segment, whole.square()).sqrt_()
        return absmax, l2, values if self.counts else None, picks, covered

    def _passes(self, gs: list[torch.Tensor], plan: Plan
                ) -> tuple[list[torch.Tensor], list[Any], list[torch.Tensor], dict[int, torch.Tensor]]:
        """Read the gradients on CPU, in ``plan`` order: the whole ones into the examined entries, the others
        twice (a dot, or the L2 of every row for one examined by rows; and an ``aminmax``), the ones with a fixed
        sample into their examined entries as well."""
        norms: dict[int, torch.Tensor] = {}
        dots, lo_hi, picked = [], [], []
        for k in plan.order:
            flat, idx = gs[k].reshape(-1), plan.index[k]
            if k in plan.rowed:  # the L2 of each row: which rows are touched, and the tensor's L2
                norms[k] = torch.linalg.vector_norm(_matrix(gs[k]), dim=1)
            elif idx is None:  # examined whole: the segment reductions of _extremes
                picked.append(flat)
                continue
            else:
                # BLAS dot of a gradient with itself: the sum of squares in one vectorized pass, about twice as fast
                # as a foreach norm on CPU; inf and NaN propagate the same way. Both passes over one tensor, then the
                # next: the second, and the examined entries, read it from the cache.
                dots.append(torch.dot(flat, flat))
                if self.counts:
                    picked.append(flat.index_select(0, idx))
            lo_hi.append(torch.aminmax(flat))  # one pass; NaN propagates into both
        return dots, lo_hi, picked, norms

    def _foreach_extremes(self, rows: tuple[int, ...], gs: list[torch.Tensor], plan: Plan
                          ) -> tuple[torch.Tensor, torch.Tensor, None, list[torch.Tensor | None], torch.Tensor | None]:
        """``_extremes`` on an accelerator, or for fp16/bf16 or non-contiguous gradients on CPU: foreach norms."""
        dtype = gs[0].dtype
        # fp16/bf16 squares would overflow: accumulate in float32
        l2 = torch.stack(foreach.norms(gs, 2, dtype=torch.float32 if dtype.itemsize < 4 else None)).double()
        if gs[0].device.type != "cpu":
            # an accelerator: two foreach kernels for the whole group instead of two launches per tensor. The L2 is
            # NaN exactly when an entry is (inf squares to inf), so it carries the NaN into the abs-max.
            top = torch.stack(foreach.norms(gs, math.inf)).double()
            absmax = torch.where(l2.isnan(), math.nan, top)
        else:
            lo_hi = [torch.aminmax(g) for g in gs]
            lows, highs = (torch.stack([mm[j] for mm in lo_hi]).double() for j in (0, 1))
            absmax = torch.maximum(highs, -lows)
        # one more pass over the gradients examined by rows: which rows are touched
        norms = {k: torch.linalg.vector_norm(_matrix(gs[k]), dim=1) for k in plan.rowed}
        picks, covered, _ = self._rows(rows, plan, norms, absmax)
        return absmax, l2, None, picks, covered

    def _rows(self, rows: tuple[int, ...], plan: Plan, norms: dict[int, torch.Tensor], absmax: torch.Tensor
              ) -> tuple[list[torch.Tensor | None], torch.Tensor | None, torch.Tensor | None]:
        """Return the indices of the examined entries per gradient (None: all), the entries they stand for (float64
        ``[P]``: the numels, the touched rows' entries for a gradient examined by rows) and the L2 of the gradients
        examined by rows from their rows' (in ``plan.rowed_index`` order); the last two None without such a one."""
        picks = list(plan.index)
        if not plan.by_rows:
            return picks, None, None
        covered, l2 = [], []
        for by_rows, sparse in plan.by_rows:
            if sparse:  # its stored rows change at every call
                by_rows = by_rows.stored(norms[by_rows.members[0]].numel())
            index, touched, norm = pick_rows([norms[k] for k in by_rows.members], by_rows,
                                             absmax.index_select(0, by_rows.index))
            for k, chosen in zip(by_rows.members, index):
                picks[k] = chosen
            covered.append(touched)
            l2.append(norm)
        numel = self._constant(("numel", rows), absmax.device, [self.numels[i] for i in rows], torch.float64)
        covered_all = numel.index_copy(0, plan.rowed_index, torch.cat(covered) if len(covered) > 1 else covered[0])
        return picks, covered_all, torch.cat(l2) if len(l2) > 1 else l2[0]

    def _values(self, gs: list[torch.Tensor], plan: Plan, picks: list[torch.Tensor | None]) -> torch.Tensor:
        """Return the examined entries of every gradient, concatenated in ``plan`` order."""
        return torch.cat([gs[k].reshape(-1) if picks[k] is None else gs[k].reshape(-1).index_select(0, picks[k])
                          for k in plan.order])

    def _sum_squares(self, w: Work, values: torch.Tensor) -> torch.Tensor:
        """Return each row's sum of ``(g / abs-max)**2`` over all entries, from the examined ones (float64)."""
        plan, device = w.plan, values.device
        unit = torch.where(torch.isfinite(w.absmax) & (w.absmax > 0), w.absmax, 1.0).float()
        r = values.abs().float() / unit.index_select(0, plan.segment)
        sums = torch.zeros(len(w.rows), dtype=torch.float64, device=device).index_add_(
            0, plan.segment, torch.where(torch.isfinite(r), r, 0.0).double().square())
        return sums * self._covered(w, device) / plan.lengths

    def _covered(self, w: Work, device: torch.device) -> torch.Tensor:
        """Return the entries that the examined ones of each row stand for (float64): the parameter's numel, or for
        one examined by rows the entries of its touched rows (the others are zeros)."""
        if w.covered is not None:
            return w.covered
        return self._constant(("numel", w.rows), device, [self.numels[i] for i in w.rows], torch.float64)

    def _counts(self, w: Work, values: torch.Tensor, simulate: torch.Tensor, floor: torch.Tensor,
                absmax: torch.Tensor, squares: bool = True, all_finite: bool = False) -> torch.Tensor:
        """Return ``[P, 6 + 3*len(FORMATS)]``: nonfinite, zeros, negligible, sampled, sampled_nonzero, the format
        counts, the smallest non-zero |g| examined, and the sum of ``(g / abs-max)**2`` (see ``_sum_squares``).
        ``w.absmax`` is the abs-max of these entries' own tensor; ``absmax`` the one merged over every rank's shard
        (the fp8 scaling, the overflow proof)."""
        device = values.device
        absmax, local = absmax.to(device), w.absmax.to(device)
        block = count_sample(values, w.plan, simulate, floor, absmax, limits(device, False), limits(device, True),
                             squares, all_finite)
        covered = self._covered(w, device)
        up = covered / block[:, 3]  # examined -> whole parameter (exact when all were examined)
        block[:, 0:3] *= up[:, None]
        block[:, -1] *= up
        if w.covered is not None:  # the untouched rows' entries are zeros
            block[:, 1] += self._constant(("numel", w.rows), device, [self.numels[i] for i in w.rows],
                                          torch.float64) - covered
        # abs-max is exact over all entries: it says exactly whether any entry is non-finite, and proves that no
        # entry can overflow a loss-scaled format when even the largest does not.
        block[:, 0] = torch.where(torch.isfinite(local), 0.0, block[:, 0].clamp_min(1.0))
        n, k = len(FORMATS), len(LOSS_SCALED)
        over = self._constant(("over",), device, [f.overflow_above for f in LOSS_SCALED], torch.float64)
        none_over = ~(absmax[:, None] * simulate.double() > over[None]) & torch.isfinite(absmax)[:, None]
        block[:, 5 + n:5 + n + k] = torch.where(none_over, 0.0, block[:, 5 + n:5 + n + k])
        return block

    def _plan(self, rows: tuple[int, ...], device: torch.device, kinds: tuple[Kind, ...]) -> Plan:
        """Return (built once per rows, device and kinds) which entries of each parameter are examined, in what
        order they are concatenated (the ones examined whole first, those examined by rows last), and the segment id
        of every examined entry."""
        key = (rows, device, kinds)
        plan = self._gather.get(key)
        if plan is None:
            index: list[torch.Tensor | None] = []
            lengths, dense, sparse = [], [], []
            for k, (i, kind) in enumerate(zip(rows, kinds)):
                n = self.numels[i]
                if self.sample is None or n <= self.sample:
                    index.append(None)  # every entry
                    lengths.append(n)
                    continue
                seed = self._seed * 1_000_003 + i
                drawn = sample_index(n, self.sample, seed)
                lengths.append(self.sample)
                index.append(drawn.to(device) if kind is None else None)
                if isinstance(kind, tuple):  # by rows
                    dense.append((k, kind, row_draws(drawn, *kind, seed)))
                elif kind is not None:  # by the rows a sparse gradient stores: their number is set at each call
                    sparse.append((k, (1, kind), row_draws(drawn, n // kind, kind, seed)))
            by_rows = ([(rows_of(*zip(*dense), device), False)] if dense else []) + [
                (rows_of([k], [shape], [draws], device), True) for k, shape, draws in sparse]
            rowed = [k for r, _ in by_rows for k in r.members]
            order = [k for k, idx in enumerate(index) if idx is None and k not in rowed]
            whole = sum(lengths[k] for k in order)
            order += [k for k, idx in enumerate(index) if idx is not None] + rowed
            segment = torch.repeat_interleave(torch.tensor(order), torch.tensor([lengths[k] for k in order]))
            sampled = torch.tensor([k for k in order if index[k] is not None] + rowed, dtype=torch.long)
            plan = self._gather[key] = Plan(index, segment.to(device), (segment * bins_per_row()).int().to(device),
                                             torch.tensor(lengths, dtype=torch.float64).to(device), tuple(order), whole,
                                             sampled.to(device), frozenset(rowed), tuple(by_rows),
                                             torch.tensor(rowed, dtype=torch.long).to(device))
        return plan


def _matrix(g: torch.Tensor) -> torch.Tensor:
    """Return ``g`` as ``[rows, cols]`` (a view: 2-D, or contiguous)."""
    return g if g.dim() == 2 else g.view(g.shape[0], -1)


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """Return the plain local tensor of a DTensor (no communication): the whole value when replicated, this rank's
    shard when sharded (its row counts only after a merge over the ranks: ``ampdoctor.monitor.reduction``);
    ``None`` for a partial one (a pending sum: the statistics of a sum are not those of its parts) or one with a
    placement ``ampdoctor._torch.distributed.placement_kind`` does not know (its shard could overlap another's),
    and anything else unchanged."""
    to_local = getattr(t, "to_local", None)
    if t is None or to_local is None or not isinstance(t, torch.Tensor):
        return t
    if grad_layout(t) in ("partial", "unknown"):
        return None
    return to_local()


@dataclass
class Work:
    """What the counts of one (device, dtype) group of a ``GradStats.begin`` still need."""

    rows: tuple[int, ...]  # the group's rows
    plan: Plan
    grads: list[torch.Tensor] | None  # the gradients as examined (None once the examined entries are copied)
    values: torch.Tensor | None  # the examined entries, in plan order
    absmax: torch.Tensor  # float64, stored units
    l2: torch.Tensor  # float64, stored units
    picks: list[torch.Tensor | None]  # the indices of the examined entries per member (None: all)
    covered: torch.Tensor | None  # float64: the entries the examined ones stand for (None: the numels)


@dataclass
class Begun:
    """The first half of a ``GradStats.compute``: rows with has_grad, numel, abs-max, L2 (and the smallest
    non-zero |g| examined) filled in, and per (device, dtype) group what the counts still need."""

    out: torch.Tensor
    work: list[Work]
    unscale: torch.Tensor | None
    simulate: torch.Tensor | None


def sample_index(n: int, k: int, seed: int) -> torch.Tensor:
    """Return ``k`` sorted random indices into ``n`` entries, drawn with replacement from a private generator.

    With replacement, so the cost is O(k log k) and not O(n) like ``randperm(n)[:k]`` (a 32768 x 4096 embedding
    would need a 1 GiB permutation); the fractions estimated from it stay unbiased.

    >>> sample_index(10**9, 4, seed=0).shape
    torch.Size([4])
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(n, (k,), generator=gen).sort().values


