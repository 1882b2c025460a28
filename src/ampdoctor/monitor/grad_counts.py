"""Count the examined gradient entries of every parameter by class, on the device, with preallocated buffers.

``count_sample`` turns the concatenated examined entries of a group of parameters into per-parameter counts
(non-finite, zeros, negligible, signal, and per format underflow, overflow and subnormal), the smallest non-zero
|g| and the sum of ``(g / amax)**2``. It reads each count off one histogram per parameter: ``bucketize`` the
entries, ``index_add_`` ones into a histogram kept in the ``Plan`` (preallocated, zeroed in place), ``cumsum``.
``bincount`` is avoided on purpose: with ``minlength`` it still reads the largest bin on the host (a device sync
on CUDA, twice per chunk here), while ``index_add_`` into a buffer of known size stays on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ampdoctor.monitor.formats import FORMATS, LOSS_SCALED

__all__ = ["Plan", "count_sample", "limits", "CODES", "CHUNK"]

CODES = (-2.5, -1.5, -0.5)  # y < these: non-finite (-3), negligible (-2), zero (-1); signal entries are >= 0
LIMITS_CACHE: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}


def limits(device: torch.device, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the sorted float32 limits ``t`` of ``count(y < t)`` and the order that restores this list: the
    codes, then per format just above the underflow limit, the smallest normal, and just above the overflow limit
    (the overflow count is the signal count minus the last). fp8 limits are divided by the format's max: their
    ``y`` is ``|g| / amax``."""
    cached = LIMITS_CACHE.get((device, fp8))
    if cached is None:
        formats = [f for f in FORMATS if (f in LOSS_SCALED) != fp8]
        unit = [f.max if fp8 else 1.0 for f in formats]
        limits = torch.tensor([[f.underflow_at_most / u for f, u in zip(formats, unit)],
                               [f.min_normal / u for f, u in zip(formats, unit)],
                               [f.overflow_above / u for f, u in zip(formats, unit)]], dtype=torch.float32)
        inf = torch.tensor(math.inf)
        limits[0] = torch.nextafter(limits[0], inf)  # y <= u  <=>  y < next float32 above u
        limits[2] = torch.nextafter(limits[2], inf)
        listed = torch.cat([torch.tensor(CODES, dtype=torch.float32), limits.reshape(-1)])
        bounds, perm = listed.sort()
        order = torch.empty_like(perm)
        order[perm] = torch.arange(perm.numel())
        cached = LIMITS_CACHE[(device, fp8)] = (bounds.to(device), order.to(device))
    return cached




@dataclass
class Plan:
    """Which entries of each parameter of a group are examined, and the buffers their counts go to (built once)."""

    index: list[torch.Tensor | None]  # entries examined per parameter (None: all)
    segment: torch.Tensor  # parameter (row) of each examined entry, in concatenation order
    offset: torch.Tensor  # segment * bins per row: the first histogram bin of that row
    lengths: torch.Tensor  # float64 entries examined per row
    hists: torch.Tensor | None = field(default=None, repr=False)  # [2, rows * bins] int64, zeroed at each count
    ones: torch.Tensor | None = field(default=None, repr=False)  # int64 ones, one per entry of a chunk

    def buffers(self, nb: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the zeroed histograms and the ones added into them (allocated on first use, then reused)."""
        rows, device = self.lengths.numel(), self.segment.device
        if self.hists is None:
            self.hists = torch.zeros((2, rows * nb), dtype=torch.int64, device=device)
            self.ones = torch.ones(min(chunk, max(self.segment.numel(), 1)), dtype=torch.int64, device=device)
        else:
            self.hists.zero_()
        return self.hists, self.ones


def count_sample(values: torch.Tensor, plan: Plan, simulate: torch.Tensor, floor: torch.Tensor, absmax: torch.Tensor,
                 limits: tuple[torch.Tensor, torch.Tensor], limits8: tuple[torch.Tensor, torch.Tensor],
                 squares: bool = True, all_finite: bool = False) -> torch.Tensor:
    """Count per parameter, over the examined entries ``values`` concatenated (``plan.segment`` says whose):
    nonfinite, zeros, negligible, examined, signal (finite, above ``floor``), then for each format the signal
    entries that round to 0, round past max, are below the smallest normal; then the smallest finite non-zero
    ``|v|`` (inf if none) and the sum of ``(v / amax)**2`` over the finite entries (NaN unless ``squares``).
    ``all_finite``: the caller knows that every entry is finite, and the non-finite code is skipped.

    Every count is ``count(y < t)`` for a limit ``t`` of ``_limits``, read off one histogram per parameter
    (``bucketize``, ``index_add_`` at ``segment * bins + bucket``, ``cumsum``). ``y`` is a code (-3 non-finite, -2
    negligible, -1 zero) or, for a signal entry, ``|v| * simulate`` (fp16, bf16) or ``|v| / amax`` (fp8). About
    twenty torch calls whatever the number of parameters: on CPU every call has a fixed cost, up to a scheduler
    slice (4-8 ms) when another process keeps the second core busy, so few calls beat small ones. Exact mode goes
    in chunks of 2**22 entries. (``|v| * simulate`` underflows float32 only for a scale below 1; it counts as
    underflow.)
    """
    rows = plan.lengths.numel()
    nb = limits[0].numel() + 1
    hists, ones = plan.buffers(nb, CHUNK)
    smallest = torch.full((rows,), math.inf, dtype=torch.float32, device=values.device)
    sumsq = torch.zeros(rows, dtype=torch.float64, device=values.device) if squares else \
        torch.full((rows,), math.nan, dtype=torch.float64, device=values.device)
    # inf/NaN amax: the scale fp8_max / amax is 0 (or NaN), and every finite entry becomes 0
    amax = torch.where(torch.isfinite(absmax), absmax, math.inf).float()
    for start in range(0, values.numel(), CHUNK):
        a = values[start:start + CHUNK].abs().float()
        segment = plan.segment[start:start + CHUNK]
        positive = a > 0  # NaN is not
        code = torch.where(a > floor, 0.0, torch.where(positive, -2.0, -1.0))
        if not all_finite:  # (the caller knows every entry is finite: their tensors' abs-max are)
            finite = torch.isfinite(a)
            code, positive = torch.where(finite, code, -3.0), finite & positive
        r = a / amax.index_select(0, segment)
        signal = code == 0
        for hist, y, (bounds, _) in zip(hists, (a * simulate, r), (limits, limits8)):
            bins = torch.bucketize(torch.where(signal, y, code), bounds, right=True)
            hist.index_add_(0, bins.add_(plan.offset[start:start + CHUNK]), ones[:bins.numel()])
        smallest.scatter_reduce_(0, segment, torch.where(positive, a, math.inf), "amin")
        if squares:
            sumsq.index_add_(0, segment, torch.where(r < math.inf, r, 0.0).double().square())  # NaN, inf: 0
    parts = []
    for hist, (_, order) in zip(hists, (limits, limits8)):
        n = hist.view(rows, nb).cumsum(1)[:, :-1].index_select(1, order).double()  # count(y < t), listed order
        k = (n.shape[1] - len(CODES)) // 3
        bad, not_negligible_yet, not_signal = n[:, 0], n[:, 1], n[:, 2]
        signal = plan.lengths - not_signal
        under, normal, within = (n[:, c:c + k] - not_signal[:, None] for c in (3, 3 + k, 3 + 2 * k))
        parts.append((bad, not_signal - not_negligible_yet, not_negligible_yet - bad, signal, under,
                      signal[:, None] - within, normal))
    (bad, zeros, negligible, signal, *scaled), fp8 = parts[0], parts[1][4:]
    head = torch.stack([bad, zeros, negligible, plan.lengths, signal], 1)
    formats = [torch.cat([s, e], 1) for s, e in zip(scaled, fp8)]
    return torch.cat([head, *formats, smallest.double()[:, None], sumsq[:, None]], 1)


CHUNK = 1 << 22  # entries per pass of count_sample: bounds its temporaries in exact mode
