"""count_sample's one joint histogram against a plain per-format count, exactly, on random and adversarial entries.

The reference below counts each format on its own, with float32 comparisons against the limits of
``ampdoctor.core.formats`` as they read (``y <= underflow_at_most``, ``y < min_normal``, ``y > overflow_above``),
so a bucket off by one at a limit, a lost NaN or a misplaced class shows as a different integer.
"""

from __future__ import annotations

import math

import pytest
import torch

from ampdoctor.core.formats import FORMATS, LOSS_SCALED
from ampdoctor.monitor.grad_counts import Plan, bins_per_row, count_sample, limits

F32 = torch.float32


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F32)


def reference(rows: list[torch.Tensor], simulate: float, floor: float, absmax: list[float]) -> list[list[float]]:
    """Count one row at a time and one format at a time: the columns of ``count_sample``."""
    out = []
    for v, top in zip(rows, absmax):
        a = v.abs().float()
        finite = torch.isfinite(a)
        signal = finite & (a > f32(floor))
        counts = [(~finite).sum(), (finite & (a == 0)).sum(), (finite & (a > 0) & (a <= f32(floor))).sum(),
                  a.numel(), signal.sum()]
        amax = f32(top if math.isfinite(top) else math.inf)
        kinds = {"under": [], "over": [], "sub": []}
        for f in FORMATS:
            scaled = f in LOSS_SCALED
            y, unit = (a * f32(simulate), 1.0) if scaled else (a / amax, f.max)
            kinds["under"].append((signal & (y <= f32(f.underflow_at_most / unit))).sum())
            kinds["over"].append((signal & (y > f32(f.overflow_above / unit))).sum())
            kinds["sub"].append((signal & (y < f32(f.min_normal / unit))).sum())
        smallest = torch.where(finite & (a > 0), a, math.inf).min() if a.numel() else torch.tensor(math.inf)
        r = a / amax
        squares = torch.where(finite & (r < math.inf), r, 0.0).double().square().sum()
        out.append([float(c) for c in counts + kinds["under"] + kinds["over"] + kinds["sub"]] +
                   [float(smallest), float(squares)])
    return out


def counted(rows: list[torch.Tensor], simulate: float, floor: float, absmax: list[float],
            all_finite: bool = False) -> list[list[float]]:
    lengths = [v.numel() for v in rows]
    segment = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
    plan = Plan([None] * len(rows), segment, segment * bins_per_row(), torch.tensor(lengths, dtype=torch.float64))
    values = torch.cat(rows)
    got = count_sample(values, plan, f32(simulate), f32(floor), torch.tensor(absmax, dtype=torch.float64),
                       limits(values.device, False), limits(values.device, True), True, all_finite)
    return got.tolist()


def at_the_limits(simulate: float) -> torch.Tensor:
    """Every limit of every format, in the units of |g|, with its float32 neighbours on either side."""
    points = []
    for f in FORMATS:
        unit = 1 / simulate if f in LOSS_SCALED else 1 / f.max  # fp8: the row's abs-max is 1
        for limit in (f.underflow_at_most, f.min_subnormal, f.min_normal, f.overflow_above, f.max):
            x = f32(limit * unit)
            points += [torch.nextafter(x, f32(0.0)), x, torch.nextafter(x, f32(math.inf))]
    return torch.stack(points)


def rows_for(simulate: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    signs = torch.where(torch.rand(300, generator=gen) < 0.5, -1.0, 1.0)
    subnormal = torch.tensor([2.0**-149, 2.0**-140, 2.0**-133, 2.0**-126 * 0.75, 0.0, -0.0])
    return [
        torch.randn(500, generator=gen) * 10.0 ** torch.randint(-12, 3, (500,), generator=gen),  # many binades
        torch.cat([at_the_limits(simulate), -at_the_limits(simulate), torch.ones(1)]),  # the row's abs-max: 1
        torch.cat([subnormal, torch.zeros(5), torch.ones(1)]),
        torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, 1e-30, 3.0]),
        torch.full((4,), float("nan")),
        signs * torch.rand(300, generator=gen) * 2.0**-20,  # everything near the fp16 underflow at scale 1
        torch.tensor([3.0e38, -3.4e38, 1e-45, 5.0]),
        torch.zeros(3),
    ]


@pytest.mark.parametrize("simulate", [1.0, 2.0**16, 1000.0, 2.0**-3, 2.0**100])
@pytest.mark.parametrize("floor", [0.0, 2.0**-24, 1e-3])
def test_one_histogram_counts_every_format_exactly_like_a_count_per_format(simulate: float, floor: float) -> None:
    rows = rows_for(simulate)
    absmax = [float(v.abs().max()) if not v.isnan().any() else math.nan for v in rows]
    assert_same(counted(rows, simulate, floor, absmax), reference(rows, simulate, floor, absmax))


def assert_same(got: list[list[float]], want: list[list[float]]) -> None:
    """Every count and the smallest |g| exactly; the sum of squares up to its order of summation."""
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g[:-1] == w[:-1], (k, [(i, a, b) for i, (a, b) in enumerate(zip(g, w)) if a != b])
        assert g[-1] == pytest.approx(w[-1], rel=1e-12, abs=0), k


@pytest.mark.parametrize("simulate", [1.0, 2.0**16, 1000.0])
def test_the_all_finite_shortcut_counts_the_same(simulate: float) -> None:
    rows = [v for v in rows_for(simulate) if torch.isfinite(v).all()]
    absmax = [float(v.abs().max()) for v in rows]
    assert_same(counted(rows, simulate, 2.0**-24, absmax, all_finite=True), reference(rows, simulate, 2.0**-24, absmax))


def test_a_non_finite_abs_max_puts_every_finite_fp8_entry_in_underflow() -> None:
    rows = [torch.tensor([1.0, 2.0, float("inf")]), torch.tensor([0.5, float("nan")])]
    got = counted(rows, 1.0, 0.0, [math.inf, math.nan])
    e4m3_under = 5 + FORMATS.index(FORMATS[2])
    assert [row[e4m3_under] for row in got] == [2.0, 1.0]
    assert_same(got, reference(rows, 1.0, 0.0, [math.inf, math.nan]))
