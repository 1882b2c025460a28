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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["FloatFormat", "FORMATS", "LOSS_SCALED", "FLOOR", "KINDS", "COLUMNS", "COL", "GradStats",
           "sample_index"]


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
LOSS_SCALED: tuple[FloatFormat, ...] = (FP16, BF16)  # simulated at the loss scale; the others at their own amax
FLOOR = 2.0**-24  # negligible below this times the largest finite |g| (fp32's 24 significant bits)

# One row per parameter. absmax and l2 are over all entries. min_nonzero is over the examined entries; zeros,
# negligible (finite, non-zero, at most the floor) and nonfinite are counts scaled up from them (exact when
# sampled == numel; nonfinite is exactly 0 when absmax is finite, and at least 1 when it is not).
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
        self._gather: dict[tuple[tuple[int, ...], torch.device], _Plan] = {}  # per (rows, device), built once
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
            work = []  # (rows, magnitudes, abs-max, L2) per group, all in stored units
            for (gdev, dtype), items in groups.items():
                # complex: the magnitudes |g| (same L2 and abs-max; g.float() would drop the imaginary part, warning)
                gs = [g.abs() if g.is_complex() else g if dtype in _NATIVE else g.float() for _, g in items]
                work.append((tuple(i for i, _ in items), gs, *self._extremes(gs)))
            # the floor, in stored units: a fraction of the largest finite |g| of every group
            top = torch.stack([torch.where(torch.isfinite(a), a, 0.0).max().to(device) for *_, a, _ in work])
            floor = (top.max() * self.floor).float()
            for rows, gs, absmax, l2 in work:
                gdev = gs[0].device
                if self.counts:
                    counts = self._counts(rows, gs, gdev, simulate.to(gdev, non_blocking=True),
                                          floor.to(gdev, non_blocking=True), absmax)
                    min_nonzero, sumsq, counts = counts[:, -2], counts[:, -1], counts[:, :-2]
                else:
                    counts = torch.full((len(rows), len(COLUMNS) - 5), math.nan, dtype=torch.float64, device=gdev)
                    min_nonzero = torch.full_like(absmax, math.nan)
                    sumsq = self._sum_squares(rows, gs, gdev, absmax)
                # float32 squares overflowed though every entry is finite: L2 = abs-max * |g / abs-max|
                l2 = torch.where(torch.isinf(l2) & torch.isfinite(absmax), absmax * sumsq.sqrt(), l2)
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
        page faults on every step, which made an abs() copy slower than the reductions themselves. The L2 is inf
        when the float32 sum of squares overflows; ``compute`` replaces it.
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

    def _values(self, rows: tuple[int, ...], gs: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor,
                                                                                                      _Plan]:
        """Return the examined entries of every gradient, concatenated, and the plan that says whose they are."""
        plan = self._plan(rows, device)
        values = torch.cat([g.reshape(-1) if idx is None else g.reshape(-1).index_select(0, idx)
                            for g, idx in zip(gs, plan.index)])
        return values, plan

    def _sum_squares(self, rows: tuple[int, ...], gs: list[torch.Tensor], device: torch.device,
                     absmax: torch.Tensor) -> torch.Tensor:
        """Return each row's sum of ``(g / abs-max)**2`` over all entries, from the examined ones (float64)."""
        values, plan = self._values(rows, gs, device)
        unit = torch.where(torch.isfinite(absmax) & (absmax > 0), absmax, 1.0).float()
        r = values.abs().float() / unit.index_select(0, plan.segment)
        sums = torch.zeros(len(rows), dtype=torch.float64, device=device).index_add_(
            0, plan.segment, torch.where(torch.isfinite(r), r, 0.0).double().square())
        return sums * self._constant(("numel", rows), device, [self.numels[i] for i in rows], torch.float64) \
            / plan.lengths

    def _counts(self, rows: tuple[int, ...], gs: list[torch.Tensor], device: torch.device,
                simulate: torch.Tensor, floor: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        """Return ``[P, 6 + 3*len(FORMATS)]``: nonfinite, zeros, negligible, sampled, sampled_nonzero, the format
        counts, the smallest non-zero |g| examined, and the sum of ``(g / abs-max)**2`` (see ``_sum_squares``)."""
        values, plan = self._values(rows, gs, device)
        absmax = absmax.to(device)
        block = _count(values, plan, simulate, floor, absmax, _limits(device, False), _limits(device, True))
        numel = self._constant(("numel", rows), device, [self.numels[i] for i in rows], torch.float64)
        up = numel / block[:, 3]  # examined -> whole parameter (exact when all were examined)
        block[:, 0:3] *= up[:, None]
        block[:, -1] *= up
        # abs-max is exact over all entries: it says exactly whether any entry is non-finite, and proves that no
        # entry can overflow a loss-scaled format when even the largest does not.
        block[:, 0] = torch.where(torch.isfinite(absmax), 0.0, block[:, 0].clamp_min(1.0))
        n, k = len(FORMATS), len(LOSS_SCALED)
        over = self._constant(("over",), device, [f.overflow_above for f in LOSS_SCALED], torch.float64)
        none_over = ~(absmax[:, None] * simulate.double() > over[None]) & torch.isfinite(absmax)[:, None]
        block[:, 5 + n:5 + n + k] = torch.where(none_over, 0.0, block[:, 5 + n:5 + n + k])
        return block

    def _plan(self, rows: tuple[int, ...], device: torch.device) -> _Plan:
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
            nb = len(_CODES) + 3 * len(LOSS_SCALED) + 1  # bins per row, the same for both histograms
            plan = self._gather[key] = _Plan(index, segment.to(device), (segment * nb).to(device),
                                             torch.tensor(lengths, dtype=torch.float64).to(device))
        return plan


_CODES = (-2.5, -1.5, -0.5)  # y < these: non-finite (-3), negligible (-2), zero (-1); signal entries are >= 0
_LIMITS: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}


def _limits(device: torch.device, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the sorted float32 limits ``t`` of ``count(y < t)`` and the order that restores this list: the
    codes, then per format just above the underflow limit, the smallest normal, and just above the overflow limit
    (the overflow count is the signal count minus the last). fp8 limits are divided by the format's max: their
    ``y`` is ``|g| / amax``."""
    cached = _LIMITS.get((device, fp8))
    if cached is None:
        formats = [f for f in FORMATS if (f in LOSS_SCALED) != fp8]
        unit = [f.max if fp8 else 1.0 for f in formats]
        limits = torch.tensor([[f.underflow_at_most / u for f, u in zip(formats, unit)],
                               [f.min_normal / u for f, u in zip(formats, unit)],
                               [f.overflow_above / u for f, u in zip(formats, unit)]], dtype=torch.float32)
        inf = torch.tensor(math.inf)
        limits[0] = torch.nextafter(limits[0], inf)  # y <= u  <=>  y < next float32 above u
        limits[2] = torch.nextafter(limits[2], inf)
        listed = torch.cat([torch.tensor(_CODES, dtype=torch.float32), limits.reshape(-1)])
        bounds, perm = listed.sort()
        order = torch.empty_like(perm)
        order[perm] = torch.arange(perm.numel())
        cached = _LIMITS[(device, fp8)] = (bounds.to(device), order.to(device))
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
    offset: torch.Tensor  # segment * bins per row: the first histogram bin of that row
    lengths: torch.Tensor  # float64 entries examined per row


def _count(values: torch.Tensor, plan: _Plan, simulate: torch.Tensor, floor: torch.Tensor, absmax: torch.Tensor,
           limits: tuple[torch.Tensor, torch.Tensor], limits8: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Count per parameter, over the examined entries ``values`` concatenated (``plan.segment`` says whose):
    nonfinite, zeros, negligible, examined, signal (finite, above ``floor``), then for each format the signal
    entries that round to 0, round past max, are below the smallest normal; then the smallest finite non-zero
    ``|v|`` (inf if none) and the sum of ``(v / amax)**2`` over the finite entries.

    Every count is ``count(y < t)`` for a limit ``t`` of ``_limits``, read off one histogram per parameter
    (``bucketize``, ``bincount`` of ``segment * bins + bucket``, ``cumsum``). ``y`` is a code (-3 non-finite, -2
    negligible, -1 zero) or, for a signal entry, ``|v| * simulate`` (fp16, bf16) or ``|v| / amax`` (fp8). About
    twenty torch calls whatever the number of parameters: on CPU every call has a fixed cost, up to a scheduler
    slice (4-8 ms) when another process keeps the second core busy, so few calls beat small ones. Exact mode goes
    in chunks of 2**22 entries. (``|v| * simulate`` underflows float32 only for a scale below 1; it counts as
    underflow.)
    """
    rows = plan.lengths.numel()
    nb = limits[0].numel() + 1
    hists = [torch.zeros(rows * nb, dtype=torch.int64, device=values.device) for _ in range(2)]
    smallest = torch.full((rows,), math.inf, dtype=torch.float32, device=values.device)
    sumsq = torch.zeros(rows, dtype=torch.float64, device=values.device)
    # inf/NaN amax: the scale fp8_max / amax is 0 (or NaN), and every finite entry becomes 0
    amax = torch.where(torch.isfinite(absmax), absmax, math.inf).float()
    for start in range(0, values.numel(), _CHUNK):
        a = values[start:start + _CHUNK].abs().float()
        segment = plan.segment[start:start + _CHUNK]
        finite = torch.isfinite(a)
        code = torch.where(finite, torch.where(a > floor, 0.0, torch.where(a > 0, -2.0, -1.0)), -3.0)
        r = a / amax.index_select(0, segment)
        for hist, y, (bounds, _) in zip(hists, (a * simulate, r), (limits, limits8)):
            bins = torch.bucketize(torch.where(code == 0, y, code), bounds, right=True)
            hist += torch.bincount(bins + plan.offset[start:start + _CHUNK], minlength=rows * nb)
        smallest.scatter_reduce_(0, segment, torch.where(finite & (a > 0), a, math.inf), "amin")
        sumsq.index_add_(0, segment, torch.where(r < math.inf, r, 0.0).double().square())  # NaN, inf: 0
    parts = []
    for hist, (_, order) in zip(hists, (limits, limits8)):
        n = hist.view(rows, nb).cumsum(1)[:, :-1].index_select(1, order).double()  # count(y < t), listed order
        k = (n.shape[1] - len(_CODES)) // 3
        bad, not_negligible_yet, not_signal = n[:, 0], n[:, 1], n[:, 2]
        signal = plan.lengths - not_signal
        under, normal, within = (n[:, c:c + k] - not_signal[:, None] for c in (3, 3 + k, 3 + 2 * k))
        parts.append((bad, not_signal - not_negligible_yet, not_negligible_yet - bad, signal, under,
                      signal[:, None] - within, normal))
    (bad, zeros, negligible, signal, *scaled), fp8 = parts[0], parts[1][4:]
    head = torch.stack([bad, zeros, negligible, plan.lengths, signal], 1)
    formats = [torch.cat([s, e], 1) for s, e in zip(scaled, fp8)]
    return torch.cat([head, *formats, smallest.double()[:, None], sumsq[:, None]], 1)


_CHUNK = 1 << 22  # entries per pass of _count: bounds its temporaries in exact mode
