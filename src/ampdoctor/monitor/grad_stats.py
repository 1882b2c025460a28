"""Batched per-parameter gradient statistics, computed on the device into one tensor, with no host sync.

``GradStats.compute`` returns a ``[n_params, len(COLUMNS)]`` float64 tensor on the gradients' device. Reading it
(``.tolist()``) is the only host sync, and the caller decides when that happens.

The statistics are always of the *unscaled* gradient. When the grads still carry the loss scale ``S`` (GradScaler
stage READY, or a fused optimizer that unscales inside its kernel) magnitudes are multiplied by ``1/S``. The
simulated casts always look at ``|g_unscaled| * S``: the value the low-precision format would have to hold.

Cost. A pass over the gradients of a 10M-parameter model takes a few ms on 2 CPU cores, a fresh buffer of that
size costs page faults on top, and every torch call has a fixed cost (more when other processes keep the second
core busy and a parallel call waits for its thread). So the work is split in two:

* over *all* entries, two reading passes and no large allocation: the L2 norm (BLAS ``torch.dot(g, g)``, or
  ``torch._foreach_norm`` for half-precision grads) and the abs-max (``torch.aminmax`` per tensor). abs-max is
  inf/NaN exactly when some entry is, and it proves a count of overflows to be exactly 0 when even the largest
  entry does not overflow;
* over a fixed sample of up to ``sample`` entries per parameter, gathered into one vector and counted with one
  histogram per parameter (a constant number of torch calls): zeros, non-finite entries, the smallest non-zero
  |g|, and the simulated underflow, overflow and subnormal counts. A parameter with at most ``sample`` entries is
  examined whole, so its counts are exact; for a larger one the fractions are unbiased estimates (±1.6% at 95% for
  4096 entries) and the smallest non-zero |g| is the smallest *examined*, an upper bound. ``sample=None`` examines
  every entry of every parameter (slow on big models; for audits and tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["FloatFormat", "FORMATS", "KINDS", "COLUMNS", "COL", "GradStats", "rows_to_dicts", "sample_index"]


@dataclass(frozen=True)
class FloatFormat:
    """A low-precision format, described by the magnitudes where round-to-nearest-even loses a value.

    Attributes:
        name: short name used in column names (``"fp16"``).
        max: the largest finite value.
        min_subnormal: the smallest positive value.
        overflow_above: ``|x| > overflow_above`` rounds past ``max`` (to inf or NaN; torch's e4m3fn cast saturates
            it to 448 instead, which loses the value just the same). It is the largest float32 that still rounds to
            a finite value.
        min_normal: the smallest normal value; below it a value keeps fewer significant bits (a subnormal).

    >>> FP16.underflow_at_most == 2**-25
    True
    """

    name: str
    max: float
    min_subnormal: float
    overflow_above: float
    min_normal: float

    @property
    def underflow_at_most(self) -> float:
        """``0 < |x| <= this`` rounds to zero: half the smallest subnormal; the tie goes to the even neighbour, 0."""
        return self.min_subnormal / 2


def _float32_below(x: float) -> float:
    """Return the largest float32 strictly below ``x``."""
    return float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(0.0)).item())


# fp16: max 65504 = (2 - 2**-10) * 2**15 has an odd mantissa, so the tie at 65520 rounds up to inf.
FP16 = FloatFormat("fp16", 65504.0, 2.0**-24, _float32_below(65520.0), 2.0**-14)
# bf16: max (2 - 2**-7) * 2**127, odd mantissa; the tie at 2**128 - 2**119 rounds up to inf.
BF16 = FloatFormat("bf16", (2 - 2.0**-7) * 2.0**127, 2.0**-133, _float32_below(2.0**128 - 2.0**119), 2.0**-126)
# e4m3fn: max 448 = 1.75 * 2**8 has an even mantissa, so the tie at 464 rounds down to 448; above it is NaN.
E4M3 = FloatFormat("e4m3", 448.0, 2.0**-9, 464.0, 2.0**-6)
# e5m2: max 57344 = 1.75 * 2**15, odd mantissa; the tie at 61440 rounds up to inf.
E5M2 = FloatFormat("e5m2", 57344.0, 2.0**-16, _float32_below(61440.0), 2.0**-14)

FORMATS: tuple[FloatFormat, ...] = (FP16, BF16, E4M3, E5M2)

# One row per parameter. absmax and l2 are over all entries. min_nonzero is over the examined entries; zeros and
# nonfinite are counts scaled up from them (exact when sampled == numel; nonfinite is exactly 0 when absmax is
# finite, and at least 1 when it is not).
# <fmt>_underflow/_overflow/_subnormal count entries among the sampled_nonzero finite non-zero sampled entries;
# _subnormal (below the smallest normal after scaling) includes those that underflow.
KINDS = ("underflow", "overflow", "subnormal")
COLUMNS: tuple[str, ...] = (
    "has_grad", "numel", "absmax", "min_nonzero", "l2", "nonfinite", "zeros", "sampled", "sampled_nonzero",
    *(f"{f.name}_{kind}" for kind in KINDS for f in FORMATS),
)
COL = {name: i for i, name in enumerate(COLUMNS)}

_NATIVE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class GradStats:
    """Compute the statistics of ``COLUMNS`` for a fixed list of parameters.

    Args:
        numels: the number of entries of each parameter, in the order of the rows.
        sample: entries per parameter examined for the counts; ``None`` examines all of them.
        seed: seed of the private generator that picks the sampled entries (the global RNG is never touched).
        counts: compute the count columns; ``False`` leaves them NaN and computes only the extremes.

    >>> g = torch.tensor([0.0, 2.0**-26, 3.0])
    >>> row = GradStats([3]).compute([g]).tolist()[0]
    >>> row[COL["zeros"]], row[COL["fp16_underflow"]], row[COL["min_nonzero"]] == 2**-26
    (1.0, 1.0, True)
    """

    def __init__(self, numels: Sequence[int], *, sample: int | None = 4096, seed: int = 0,
                 counts: bool = True) -> None:
        if sample is not None and (not isinstance(sample, int) or sample < 1):
            raise ValueError(f"sample must be a positive number of entries or None, got {sample!r}")
        self.numels = [int(n) for n in numels]
        self.sample = sample
        self.counts = counts
        self._seed = seed
        self._gather: dict[tuple[tuple[int, ...], torch.device], _Plan] = {}  # per (rows, device), built once
        self._thresholds: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._constants: dict[tuple[object, torch.device], torch.Tensor] = {}

    def _constant(self, key: tuple[object, ...], device: torch.device, values: Sequence[float],
                  dtype: torch.dtype) -> torch.Tensor:
        # Built once per device: a host-to-device copy of pageable memory would wait for the device.
        cached = self._constants.get((key, device))
        if cached is None:
            cached = self._constants[(key, device)] = torch.tensor(list(values), dtype=dtype, device=device)
        return cached

    def compute(self, grads: Sequence[torch.Tensor | None], scale: torch.Tensor | float | None = None,
                scaled: bool = False) -> torch.Tensor:
        """Return the ``[len(grads), len(COLUMNS)]`` float64 statistics on the grads' device, without a host sync.

        Args:
            grads: one gradient (or ``None``) per parameter given at construction. Sparse grads are skipped.
            scale: the loss scale ``S`` of this backward (a 0-dim tensor or a number); ``None`` means 1.
            scaled: whether ``grads`` still carry ``S`` (GradScaler stage READY) or are already unscaled.
        """
        if len(grads) != len(self.numels):
            raise ValueError(f"expected {len(self.numels)} gradients (one per parameter), got {len(grads)}")
        grads = [local_tensor(g) for g in grads]
        present = [(i, g) for i, g in enumerate(grads)
                   if g is not None and not g.is_sparse and g.numel() and g.numel() == self.numels[i]]
        device = present[0][1].device if present else torch.device("cpu")
        out = torch.full((len(grads), len(COLUMNS)), math.nan, dtype=torch.float64, device=device)
        out[:, COL["has_grad"]] = 0.0
        out[:, COL["numel"]] = self._constant(("numels",), device, self.numels, torch.float64)
        if not present:
            return out
        with torch.no_grad():
            s = torch.ones((), dtype=torch.float32, device=device) if scale is None else \
                torch.as_tensor(scale, dtype=torch.float32).to(device, non_blocking=True)
            # Unscale like GradScaler.unscale_ (reciprocal in float64). Simulate |g_unscaled| * S.
            unscale = s.double().reciprocal() if scaled else torch.ones((), dtype=torch.float64, device=device)
            simulate = torch.ones((), dtype=torch.float32, device=device) if scaled else s
            groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
            for i, g in present:
                groups.setdefault((g.device, g.dtype), []).append((i, g))
            for (gdev, dtype), items in groups.items():
                rows = tuple(i for i, _ in items)
                # complex: the magnitudes |g| (same L2 and abs-max as g; g.float() would drop the imaginary part
                # and warn)
                gs = [g.abs() if g.is_complex() else g if dtype in _NATIVE else g.float() for _, g in items]
                absmax, l2 = self._extremes(gs)
                if self.counts:
                    counts = self._counts(rows, gs, gdev, simulate.to(gdev, non_blocking=True), absmax)
                    min_nonzero, counts = counts[:, -1], counts[:, :-1]
                else:
                    counts = torch.full((len(rows), len(COLUMNS) - 5), math.nan, dtype=torch.float64, device=gdev)
                    min_nonzero = torch.full_like(absmax, math.nan)
                block = torch.cat([torch.stack([absmax, min_nonzero, l2], 1).to(device, non_blocking=True),
                                   counts.to(device, non_blocking=True)], 1)
                block[:, 0:3] *= unscale
                index = self._constant(("rows", rows), device, rows, torch.long)
                out[index, COL["has_grad"]:] = torch.cat(
                    [torch.ones((len(rows), 1), dtype=torch.float64, device=device),
                     out[index, COL["numel"]:COL["numel"] + 1], block], 1)
        return out

    def _extremes(self, gs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return float64 abs-max (NaN if any NaN) and L2 norm per gradient, over all entries, in stored units.

        Two reading passes and no allocation the size of the gradients: on CPU a fresh buffer of that size costs
        page faults on every step, which made an abs() copy slower than the reductions themselves.
        """
        dtype = gs[0].dtype
        if dtype.itemsize >= 4 and all(g.is_contiguous() for g in gs):
            # BLAS dot of a gradient with itself: the sum of squares in one vectorized pass, about twice as fast
            # as _foreach_norm on CPU; inf and NaN propagate the same way.
            l2 = torch.stack([torch.dot(f, f) for f in (g.reshape(-1) for g in gs)]).double().sqrt()
        else:  # fp16/bf16 squares would overflow: accumulate in float32
            l2 = torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float32 if dtype.itemsize < 4 else None)).double()
        lo_hi = [torch.aminmax(g) for g in gs]  # one pass each; NaN propagates into both
        lows = torch.stack([mm.min for mm in lo_hi]).double()
        highs = torch.stack([mm.max for mm in lo_hi]).double()
        return torch.maximum(highs, -lows), l2

    def _counts(self, rows: tuple[int, ...], gs: list[torch.Tensor], device: torch.device,
                simulate: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        """Return ``[P, 5 + 3*len(FORMATS)]``: nonfinite, zeros, sampled, sampled_nonzero, the format counts, and
        the smallest non-zero |g| examined."""
        plan = self._plan(rows, device)
        values = torch.cat([g.reshape(-1) if idx is None else g.reshape(-1).index_select(0, idx)
                            for g, idx in zip(gs, plan.index)])
        block = _count(values, plan, simulate, *self._limits(device))
        numel = self._constant(("numel", rows), device, [self.numels[i] for i in rows], torch.float64)
        # Scale the examined zero/non-finite counts up to the whole parameter (exact when all were examined).
        block[:, 0:2] *= (numel / block[:, 2])[:, None]
        # abs-max is exact over all entries: it says exactly whether any entry is non-finite, and proves that no
        # entry can overflow a format when even the largest does not.
        absmax = absmax.to(device)
        block[:, 0] = torch.where(torch.isfinite(absmax), 0.0, block[:, 0].clamp_min(1.0))
        n = len(FORMATS)
        over = self._constant(("over",), device, [f.overflow_above for f in FORMATS], torch.float64)
        none_over = ~(absmax[:, None] * simulate.double() > over[None]) & torch.isfinite(absmax)[:, None]
        block[:, 4 + n:4 + 2 * n] = torch.where(none_over, 0.0, block[:, 4 + n:4 + 2 * n])
        return block

    def _plan(self, rows: tuple[int, ...], device: torch.device) -> "_Plan":
        """Return (built once per rows and device) which entries of each parameter are examined, and the segment
        id of every examined entry in their concatenation."""
        key = (rows, device)
        plan = self._gather.get(key)
        if plan is None:
            index: list[torch.Tensor | None] = []
            lengths = []
            for i in rows:
                n = self.numels[i]
                if self.sample is None or n <= self.sample:
                    index.append(None)  # every entry
                    lengths.append(n)
                else:
                    index.append(sample_index(n, self.sample, self._seed * 1_000_003 + i).to(device))
                    lengths.append(self.sample)
            segment = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
            nb = self._limits(device)[0].numel() + 1
            plan = self._gather[key] = _Plan(index, segment.to(device), (segment * nb).to(device),
                                             torch.tensor(lengths, dtype=torch.float64).to(device))
        return plan

    def _limits(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the sorted float32 limits ``t`` of ``count(y < t)`` and the order that restores this list:
        -1.5 (non-finite), the smallest positive float32 (``y <= 0``), then per format just above the underflow
        limit, the smallest normal, and just above the overflow limit (the overflow count is the non-zero count
        minus the last)."""
        cached = self._thresholds.get(device)
        if cached is None:
            limits = torch.tensor([[f.underflow_at_most for f in FORMATS], [f.min_normal for f in FORMATS],
                                   [f.overflow_above for f in FORMATS]], dtype=torch.float32)
            inf = torch.tensor(math.inf)
            limits[0] = torch.nextafter(limits[0], inf)  # y <= u  <=>  y < next float32 above u
            limits[2] = torch.nextafter(limits[2], inf)
            listed = torch.cat([torch.tensor([-1.5, _TINY], dtype=torch.float32), limits.reshape(-1)])
            bounds, perm = listed.sort()
            order = torch.empty_like(perm)
            order[perm] = torch.arange(perm.numel())
            cached = self._thresholds[device] = (bounds.to(device), order.to(device))
        return cached


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """Return the plain local tensor of a replicated DTensor (the whole value, no communication), ``None`` for a
    DTensor that is sharded or partial (its local part is not the whole: left out rather than misreported), and
    anything else unchanged."""
    to_local = getattr(t, "to_local", None)
    if t is None or to_local is None or not isinstance(t, torch.Tensor):
        return t
    placements = getattr(t, "placements", ())
    if all(type(p).__name__ == "Replicate" for p in placements):
        return to_local()
    return None


def sample_index(n: int, k: int, seed: int) -> torch.Tensor:
    """Return ``k`` sorted random indices into ``n`` entries, drawn with replacement from a private generator.

    With replacement, so the cost is O(k log k) and not O(n) like ``randperm(n)[:k]`` (a 32768 x 4096 embedding
    would need a 1 GiB permutation); the fractions estimated from it stay unbiased.

    >>> sample_index(10**9, 4, seed=0).shape
    torch.Size([4])
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(n, (k,), generator=gen).sort().values


@dataclass(frozen=True)
class _Plan:
    index: list[torch.Tensor | None]  # entries examined per parameter (None: all)
    segment: torch.Tensor  # parameter (row) of each examined entry, in concatenation order
    offset: torch.Tensor  # segment * (number of limits + 1): the first histogram bin of that row
    lengths: torch.Tensor  # float64 entries examined per row


def _count(values: torch.Tensor, plan: _Plan, simulate: torch.Tensor, bounds: torch.Tensor,
           order: torch.Tensor) -> torch.Tensor:
    """Count per parameter, over the examined entries ``values`` concatenated (``plan.segment`` says whose):
    nonfinite, zeros, examined, finite non-zero, then for each format the finite non-zero entries whose
    ``|v| * simulate`` (as float32) rounds to 0, rounds past max, is below the smallest normal; last the smallest
    finite non-zero ``|v|`` (inf if none).

    Every count is ``count(y < t)`` for ``y = |v| * simulate`` (-2 for a non-finite entry) and a limit ``t`` of
    ``_limits``, read off one histogram per parameter: ``bucketize`` against the sorted limits, ``bincount`` of
    ``segment * (limits + 1) + bucket``, ``cumsum``. That is ten torch calls whatever the number of parameters:
    on CPU every call has a fixed cost, which grows to a scheduler slice (4-8 ms) when another process keeps the
    second core busy, so few calls beat small ones. Exact mode (every entry) goes in chunks of 2**22 entries.
    (``|v| * simulate`` underflows float32 only for a scale below 1 and |v| near 1e-45; that entry counts as 0.)
    """
    rows = plan.lengths.numel()
    nb = bounds.numel() + 1
    hist = torch.zeros(rows * nb, dtype=torch.int64, device=values.device)
    smallest = torch.full((rows,), math.inf, dtype=torch.float32, device=values.device)
    for start in range(0, values.numel(), _CHUNK):
        a = values[start:start + _CHUNK].abs().float()
        y = torch.where(torch.isfinite(a), a * simulate, -2.0)
        bins = torch.bucketize(y, bounds, right=True) + plan.offset[start:start + _CHUNK]
        hist += torch.bincount(bins, minlength=rows * nb)
        smallest.scatter_reduce_(0, plan.segment[start:start + _CHUNK], torch.where(y > 0, a, math.inf), "amin")
    n = hist.view(rows, nb).cumsum(1)[:, :-1].index_select(1, order).double()  # count(y < t), _limits order
    f = len(FORMATS)
    bad, not_positive = n[:, 0], n[:, 1]
    nonzero = plan.lengths - not_positive
    under, normal, within = (n[:, k:k + f] - not_positive[:, None] for k in (2, 2 + f, 2 + 2 * f))
    head = torch.stack([bad, not_positive - bad, plan.lengths, nonzero], 1)
    return torch.cat([head, under, nonzero[:, None] - within, normal, smallest.double()[:, None]], 1)


_CHUNK = 1 << 22  # entries per pass of _count: bounds its temporaries in exact mode
_TINY = 2.0**-149  # the smallest positive float32: y < _TINY  <=>  y <= 0


def rows_to_dicts(matrix: Sequence[Sequence[float]], names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Turn host rows of ``GradStats.compute`` into ``{name: {stat: value}}``, with fractions instead of counts.

    ``zero_frac`` is of all entries; ``<fmt>_underflow`` / ``_overflow`` / ``_subnormal`` are of the finite
    non-zero entries examined, ``min_nonzero`` the smallest of them. Parameters without a gradient are left out.

    >>> rows_to_dicts([[1, 4, 3.0, 0.5, 3.1, 0, 1, 4, 3, 1] + [0] * 11], ["w"])["w"]["fp16_underflow"]
    0.3333333333333333
    """
    out: dict[str, dict[str, float]] = {}
    for name, row in zip(names, matrix):
        if not row[COL["has_grad"]]:
            continue
        numel = row[COL["numel"]]
        nonzero = row[COL["sampled_nonzero"]]
        stats: dict[str, float] = {"absmax": row[COL["absmax"]], "l2": row[COL["l2"]]}
        if not math.isnan(row[COL["sampled"]]):  # counts were computed
            stats.update(min_nonzero=row[COL["min_nonzero"]], nonfinite=int(round(row[COL["nonfinite"]])),
                         zero_frac=row[COL["zeros"]] / numel if numel else 0.0, sampled=int(row[COL["sampled"]]))
            for kind in KINDS:
                for f in FORMATS:
                    key = f"{f.name}_{kind}"
                    stats[key] = row[COL[key]] / nonzero if nonzero else 0.0
        out[name] = stats
    return out
