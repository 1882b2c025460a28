"""Count the examined gradient entries of every parameter by class, on the device, with preallocated buffers.

``count_sample`` turns the concatenated examined entries of a group of parameters into per-parameter counts
(non-finite, zeros, negligible, signal, and per format underflow, overflow and subnormal), the smallest non-zero
|g| and the sum of ``(g / amax)**2``. Every count comes from one joint histogram per parameter, filled by one
``index_add_`` over the entries: each entry's bin is its class (zero, negligible, signal, non-finite) and, for a
signal entry, the bucket of its value at the loss scale among the fp16 and bf16 limits and the bucket of its
value over the abs-max among the e4m3 and e5m2 limits. A bucket is a count of limits at or below the value, and
for non-negative float32 values that order is the order of their int32 bit patterns: each count is one broadcast
integer subtraction, a sign shift and a sum over the limits (``torch.bucketize``'s binary search took 0.35 ms per
family on 99k entries, these 0.1 ms), and the class is the same count against the limits 0, the floor and inf.
``bincount`` is avoided on purpose: with ``minlength`` it still reads the largest bin on the host (a device sync
on CUDA, twice per chunk here), while ``index_add_`` into a buffer of known size stays on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ampdoctor.core.formats import FORMATS, LOSS_SCALED
from ampdoctor.monitor.grad_rows import Rows

__all__ = ["Plan", "count_sample", "at_least", "limits", "bins_per_row", "CLASSES", "CHUNK"]

CLASSES = ("zero", "negligible", "signal", "nonfinite")  # an entry's class: its row of the joint histogram
LIMITS_CACHE: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
CLASS_BITS_CACHE: dict[torch.device, torch.Tensor] = {}


def limits(device: torch.device, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the sorted float32 limits ``t`` of ``count(y < t)`` and the order that restores this list: per format
    just above the underflow limit, the smallest normal, and just above the overflow limit (the overflow count is
    the signal count minus the last). fp8 limits are divided by the format's max: their ``y`` is ``|g| / amax``."""
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
        bounds, perm = limits.reshape(-1).sort()
        order = torch.empty_like(perm)
        order[perm] = torch.arange(perm.numel())
        cached = LIMITS_CACHE[(device, fp8)] = (bounds.to(device), order.to(device))
    return cached


def bins_per_row() -> int:
    """Return the joint histogram's bins per parameter: a class, then a loss-scaled bucket, then an fp8 bucket."""
    scaled, fp8 = 3 * len(LOSS_SCALED) + 1, 3 * (len(FORMATS) - len(LOSS_SCALED)) + 1
    return len(CLASSES) * scaled * fp8


@dataclass
class Plan:
    """Which entries of each parameter of a group are examined, in what order, and the buffers their counts go to
    (built once per group).

    The examined entries are concatenated member by member in ``order``: the members examined whole first, then
    the sampled ones (those with a fixed sample, then those examined by rows). So the first ``whole`` entries are
    whole tensors, whose abs-max and L2 come from them (no pass of their own), and ``segment[:whole]`` says whose
    they are. The entries of a member examined by rows (``ampdoctor.monitor.grad_rows``) are picked at each call
    among its touched rows, from its ``by_rows`` draws."""

    index: list[torch.Tensor | None]  # entries examined per member, in the group's order (None: all, or by rows)
    segment: torch.Tensor  # member (row of the group) of each examined entry, in concatenation order
    offset: torch.Tensor  # int32 segment * bins_per_row(): the first histogram bin of that row
    lengths: torch.Tensor  # float64 entries examined per member, in the group's order
    order: tuple[int, ...] = ()  # the members in concatenation order: the whole ones, then the sampled ones
    whole: int = 0  # entries of the whole members: the head of the concatenation
    sampled: torch.Tensor | None = None  # long: the members examined in part, in concatenation order
    rowed: frozenset[int] = frozenset()  # the members examined by rows
    by_rows: tuple[tuple[Rows, bool], ...] = ()  # their draws: (rows, whether sparse), the dense ones together
    rowed_index: torch.Tensor | None = None  # long: the members examined by rows, in the order of by_rows
    hist: torch.Tensor | None = field(default=None, repr=False)  # [rows * bins] int64, zeroed at each count
    ones: torch.Tensor | None = field(default=None, repr=False)  # int64 ones, one per entry of a chunk

    def __post_init__(self) -> None:
        if not self.order:
            self.order = tuple(range(len(self.index)))

    def buffers(self, nb: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the zeroed histogram and the ones added into it (allocated on first use, then reused)."""
        rows, device = self.lengths.numel(), self.segment.device
        if self.hist is None:
            self.hist = torch.zeros(rows * nb, dtype=torch.int64, device=device)
            self.ones = torch.ones(min(chunk, max(self.segment.numel(), 1)), dtype=torch.int64, device=device)
        else:
            self.hist.zero_()
        return self.hist, self.ones


def _class_bits(device: torch.device) -> torch.Tensor:
    """Return the int32 bits of the smallest positive float32 (2**-149) and of inf, on ``device`` (built once: a
    host-to-device copy of pageable memory would wait for the device)."""
    cached = CLASS_BITS_CACHE.get(device)
    if cached is None:
        cached = CLASS_BITS_CACHE[device] = torch.tensor([2.0**-149, math.inf]).view(torch.int32).to(device)
    return cached


def at_least(y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Return, per entry of the float32 ``y``, how many of the limits whose int32 bit patterns are ``bits``
    (``[n, 1]``) are at or below it (int32): exact for ``y >= 0`` (NaN above every limit), in ``[0, n]`` for any y.

    Non-negative float32 values order like their bit patterns read as int32, and ``d >> 31`` is -1 for a negative
    difference and 0 otherwise (a difference that wraps comes only from a negative y, whose count is then
    meaningless but still in range).

    >>> bits = torch.tensor([[1.0], [2.0]]).view(torch.int32)
    >>> at_least(torch.tensor([0.5, 1.0, 3.0]), bits).tolist()
    [0, 1, 2]
    """
    return torch.sub(y.view(torch.int32), bits).bitwise_right_shift_(31).sum(0, dtype=torch.int32).add_(len(bits))


def count_sample(values: torch.Tensor, plan: Plan, simulate: torch.Tensor, floor: torch.Tensor, absmax: torch.Tensor,
                 limits: tuple[torch.Tensor, torch.Tensor], limits8: tuple[torch.Tensor, torch.Tensor],
                 squares: bool = True, all_finite: bool = False) -> torch.Tensor:
    """Count per parameter, over the examined entries ``values`` concatenated (``plan.segment`` says whose):
    nonfinite, zeros, negligible, examined, signal (finite, above ``floor``), then for each format the signal
    entries that round to 0, round past max, are below the smallest normal; then the smallest finite non-zero
    ``|v|`` (inf if none) and the sum of ``(v / amax)**2`` over the finite entries (NaN unless ``squares``).
    ``all_finite``: the caller knows that every entry is finite, and the non-finite class is skipped.

    Each entry lands in one bin of its row's joint histogram (``index_add_`` at ``segment * bins + bin``): its
    class (``CLASSES``), the bucket of ``|v| * simulate`` among the fp16 and bf16 limits and the bucket of
    ``|v| / amax`` among the fp8 ones (see ``at_least``). A format count is ``count(y < t)`` over the signal entries,
    a cumulative sum over one family's buckets. About thirty torch calls whatever the number of parameters: on CPU
    every call has a fixed cost, up to a scheduler slice (4-8 ms) when another process keeps the second core busy,
    so few calls beat small ones. Exact mode goes in chunks of 2**22 entries. (``|v| * simulate`` underflows
    float32 only for a scale below 1; it counts as underflow.)
    """
    rows, device = plan.lengths.numel(), values.device
    ny, nr = limits[0].numel() + 1, limits8[0].numel() + 1
    hist, ones = plan.buffers(len(CLASSES) * ny * nr, CHUNK)
    smallest = torch.full((rows,), math.inf, dtype=torch.float32, device=device)
    sumsq = torch.zeros(rows, dtype=torch.float64, device=device) if squares else \
        torch.full((rows,), math.nan, dtype=torch.float64, device=device)
    # inf/NaN amax: the scale fp8_max / amax is 0 (or NaN), and every finite entry becomes 0
    amax = torch.where(torch.isfinite(absmax), absmax, math.inf).float()
    # the class: how many of (the smallest positive float32, just above the floor, inf) the entry reaches
    ends = _class_bits(device)  # 2**-149 and inf
    above_floor = floor.float().reshape(1).view(torch.int32) + 1
    classes = torch.cat([ends[:1], above_floor, *([] if all_finite else [ends[1:]])])[:, None]
    bits, bits8 = limits[0].view(torch.int32)[:, None], limits8[0].view(torch.int32)[:, None]
    for start in range(0, values.numel(), CHUNK):
        a = values[start:start + CHUNK].abs().float()
        if not all_finite:  # (the caller knows every entry is finite: their tensors' abs-max are)
            a = a.nan_to_num(nan=math.inf, posinf=math.inf)  # NaN joins inf: the non-finite class is |v| = inf
        segment = plan.segment[start:start + CHUNK]
        r = a / amax.index_select(0, segment)
        # the bin: class, then loss-scaled bucket, then fp8 bucket (NaN r, of a zero or inf entry: any bucket)
        key = at_least(a, classes).mul_(ny).add_(at_least(a * simulate, bits)).mul_(nr).add_(at_least(r, bits8))
        hist.index_add_(0, key.add_(plan.offset[start:start + CHUNK]), ones[:key.numel()])
        # the smallest non-zero |v|: a zero becomes inf (FLOAT32_MAX * 2 overflows; 0 * it stays 0), inf stays
        smallest.scatter_reduce_(0, segment, (1 - a.sign()).mul_(_FLOAT32_MAX).mul_(2.0).add_(a), "amin")
        if squares:
            sumsq.index_add_(0, segment, torch.where(r < math.inf, r, 0.0).double().square())  # NaN, inf: 0
    return torch.cat([*_counts(hist.view(rows, len(CLASSES), ny, nr).double(), plan.lengths, limits[1], limits8[1]),
                      smallest.double()[:, None], sumsq[:, None]], 1)


def _counts(hist: torch.Tensor, lengths: torch.Tensor, order: torch.Tensor, order8: torch.Tensor
            ) -> list[torch.Tensor]:
    """Return ``[nonfinite, zeros, negligible, examined, signal]`` and per kind (underflow, overflow, subnormal)
    the counts of every format, from the joint histogram ``[rows, class, loss-scaled bucket, fp8 bucket]``."""
    per_class = hist.sum((2, 3))
    zeros, negligible, signal, bad = (per_class[:, CLASSES.index(c)] for c in CLASSES)
    kinds = []
    for family, order_ in ((hist[:, CLASSES.index("signal")].sum(2), order),
                           (hist[:, CLASSES.index("signal")].sum(1), order8)):
        below = family.cumsum(1)[:, :-1].index_select(1, order_)  # count(y < t) of the signal, listed order
        k = below.shape[1] // 3
        kinds.append((below[:, :k], signal[:, None] - below[:, 2 * k:], below[:, k:2 * k]))
    head = torch.stack([bad, zeros, negligible, lengths, signal], 1)
    return [head, *(torch.cat([scaled, fp8], 1) for scaled, fp8 in zip(*kinds))]


CHUNK = 1 << 22  # entries per pass of count_sample: bounds its temporaries in exact mode
