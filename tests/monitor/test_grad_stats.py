"""GradStats against an independent float64 NumPy computation on the same gradients.

fp16/bf16 are simulated at the loss scale; e4m3/e5m2 with per-tensor amax scaling (``|g| * fp8_max / amax``). The
format counts leave out negligible entries (at most ``floor`` times the largest finite |g| of the call).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from op_count import CountOps

from ampdoctor.monitor.grad_stats import COL, COLUMNS, FLOOR, FORMATS, GradStats
from ampdoctor.monitor.gradients import rows_to_dicts

# Formats described only by their bit layout, independently of ampdoctor's constants:
# (mantissa bits, exponent of the largest binade, mantissa of the largest finite value, smallest normal exponent)
LAYOUT = {"fp16": (10, 15, 1023, -14), "bf16": (7, 127, 127, -126), "e4m3": (3, 8, 6, -6), "e5m2": (2, 15, 3, -14)}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # the per-tensor scale is fp8_max / amax


def np_rounds_to_zero(x: np.ndarray, fmt: str) -> np.ndarray:
    """|x| rounds to 0 under round-to-nearest-even: at most half the smallest subnormal (the tie goes to 0)."""
    m, _, _, emin = LAYOUT[fmt]
    return np.abs(x) <= 2.0 ** (emin - m) / 2


def np_overflows(x: np.ndarray, fmt: str) -> np.ndarray:
    """|x| rounds past the largest finite value: beyond the midpoint to the next binade value, or on it when the
    largest value's mantissa is odd (ties go to even)."""
    m, emax, top, _ = LAYOUT[fmt]
    largest = (1 + top / 2**m) * 2.0**emax
    midpoint = largest + 2.0 ** (emax - m) / 2
    return np.abs(x) >= midpoint if top % 2 else np.abs(x) > midpoint


def np_stats(g: torch.Tensor, scale: float, scaled: bool, top: float | None = None,
             floor: float = 0.0) -> dict[str, float]:
    """The reference: float64 NumPy on the stored gradient; np.float16 casting for fp16 as a second opinion.

    ``top`` is the largest finite unscaled |g| of the whole call (this gradient's when None); entries at most
    ``floor * top`` are negligible and left out of the format fractions.
    """
    stored = g.detach().double().numpy().reshape(-1)
    unscaled = stored / scale if scaled else stored
    finite = np.isfinite(unscaled)
    if top is None:
        top = float(np.max(np.abs(unscaled[finite]), initial=0.0))
    nonzero = finite & (unscaled != 0)
    signal = finite & (np.abs(unscaled) > floor * top)
    x = np.abs(unscaled) * scale  # exact in float64 for float32/16 values and power-of-two scales
    amax = float(np.max(np.abs(unscaled))) if np.all(finite) else math.inf
    out = {
        "absmax": float(np.max(np.abs(unscaled))),
        "min_nonzero": float(np.nanmin(np.abs(unscaled[unscaled != 0]))) if np.any(unscaled != 0) else math.inf,
        "l2": float(np.sqrt(np.sum(unscaled.astype(np.float64) ** 2))),
        "nonfinite": int(np.sum(~finite)),
        "zero_frac": float(np.mean(unscaled == 0)),
        "negligible_frac": float(np.mean(nonzero & ~signal)),
    }
    denominator = max(int(signal.sum()), 1)
    for fmt in LAYOUT:
        y = np.abs(unscaled) / amax * FP8_MAX[fmt] if fmt in FP8_MAX else x
        out[f"{fmt}_underflow"] = float(np.sum(np_rounds_to_zero(y, fmt) & signal)) / denominator
        out[f"{fmt}_overflow"] = float(np.sum(np_overflows(y, fmt) & signal)) / denominator
        out[f"{fmt}_subnormal"] = float(np.sum((y < 2.0 ** LAYOUT[fmt][3]) & signal)) / denominator
    with np.errstate(over="ignore"):
        half = x[signal].astype(np.float16)
    assert out["fp16_underflow"] == float(np.sum(half == 0)) / denominator
    assert out["fp16_overflow"] == float(np.sum(np.isinf(half))) / denominator
    return out


def ours(grads: list[torch.Tensor], scale: float, scaled: bool, sample: int | None = None,
         floor: float = 0.0) -> list[dict]:
    stats = GradStats([g.numel() for g in grads], sample=sample, floor=floor)
    matrix = stats.compute(grads, torch.tensor(scale), scaled=scaled).tolist()
    names = [str(i) for i in range(len(grads))]
    found = rows_to_dicts(matrix, names)
    return [found[n] for n in names]


def assert_matches(got: dict, want: dict) -> None:
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=0), key


def test_known_underflow_three_of_ten_at_scale_1_and_none_at_2_pow_10() -> None:
    # 2**-25 ≈ 2.98e-8 is half of fp16's smallest subnormal: at or below it a value rounds to 0.
    g = torch.tensor([1e-9, -2e-8, 2.0**-25, 3.0e-8, 1e-4, 0.5, -1.0, 2.0, 1e-3, 7.0, 0.0, 0.0])
    at_1, at_1024 = ours([g], 1.0, False)[0], ours([g], 2.0**10, False)[0]
    assert at_1["fp16_underflow"] == pytest.approx(3 / 10)
    assert at_1024["fp16_underflow"] == 0.0
    assert at_1["zero_frac"] == pytest.approx(2 / 12)
    assert at_1["min_nonzero"] == pytest.approx(1e-9)
    # fp16 subnormals lie below 2**-14 ≈ 6.1e-5: the three that underflow and 3e-8 (1e-4 is above)
    assert at_1["fp16_subnormal"] == pytest.approx(4 / 10)
    assert at_1024["fp16_subnormal"] == pytest.approx(4 / 10)  # 1e-9 .. 3e-8 times 1024 are still below 6.1e-5
    # overflow at 2**16: |g| * 65536 >= 65520 for 2.0 and 7.0 and -1.0 (65536 rounds to inf)
    assert ours([g], 2.0**16, False)[0]["fp16_overflow"] == pytest.approx(3 / 10)


def test_known_thresholds_of_each_format_exactly() -> None:
    # Values on and just around fp16's and bf16's rounding boundaries, at scale 1.
    below = lambda v: float(np.nextafter(np.float32(v), np.float32(0)))  # noqa: E731
    g = torch.tensor([65520.0, below(65520.0), 2.0**-25, 2.0**-24, 2.0**-134, 2.0**-133, 1.0])
    got = ours([g], 1.0, False)[0]
    assert_matches(got, np_stats(g, 1.0, False))
    n = 7
    assert got["fp16_overflow"] == pytest.approx(1 / n)  # 65520 only
    assert got["fp16_underflow"] == pytest.approx(3 / n)  # 2**-25 ties to 0; 2**-134 and 2**-133 too
    assert got["bf16_underflow"] == pytest.approx(1 / n)  # 2**-134 ties to 0; 2**-133 is bf16's smallest


def test_fp8_uses_per_tensor_amax_scaling_and_cannot_overflow() -> None:
    # amax 448: e4m3's scale 448 / amax is 1, so e4m3 sees the values themselves. 2**-10 ties to 0; 2**-9 is
    # e4m3's smallest subnormal, 2**-6 its smallest normal.
    above = lambda v: float(np.nextafter(np.float32(v), np.float32(np.inf)))  # noqa: E731
    g = torch.tensor([448.0, 2.0**-10, above(2.0**-10), 2.0**-9, 2.0**-7, 2.0**-6, 1.0, 0.0])
    got = ours([g], 1.0, False)[0]
    assert_matches(got, np_stats(g, 1.0, False))
    n = 7
    assert got["e4m3_underflow"] == pytest.approx(1 / n)
    assert got["e4m3_subnormal"] == pytest.approx(4 / n)  # 2**-10 .. 2**-7
    assert got["e4m3_overflow"] == 0.0 and got["e5m2_overflow"] == 0.0  # the largest entry lands on fp8 max
    # The loss scale moves fp16, never fp8: per-tensor scaling divides it out again.
    big = ours([g], 2.0**20, False)[0]
    assert big["fp16_overflow"] > 0 and big["e4m3_underflow"] == got["e4m3_underflow"]
    # The same shape at any magnitude gives the same fp8 counts (the old loss-scale simulation overflowed e4m3
    # above 464 and flushed everything below 2**-10).
    for factor in (2.0**-30, 2.0**30):
        scaled_copy = ours([g * factor], 1.0, False)[0]
        for key in ("e4m3_underflow", "e4m3_subnormal", "e5m2_underflow", "e5m2_subnormal"):
            assert scaled_copy[key] == pytest.approx(got[key]), key


def test_fp8_of_a_tensor_with_inf_flushes_every_finite_entry() -> None:
    # current scaling: scale = 448 / inf = 0, so every finite entry becomes 0
    g = torch.tensor([1.0, 2.0, math.inf, 3.0])
    got = ours([g], 1.0, False)[0]
    assert got["e4m3_underflow"] == 1.0 and got["e5m2_underflow"] == 1.0 and got["e4m3_overflow"] == 0.0


def test_negligible_entries_are_left_out_of_the_format_counts() -> None:
    # 7.0 is the largest entry: 7 * 2**-24 ≈ 4.2e-7 is the floor. 1e-9 .. 3e-8 are below it (rounding-level next
    # to 7.0), so they are negligible, not underflow; 1e-6 is signal and an fp16 subnormal at scale 1.
    g = torch.tensor([1e-9, -2e-8, 2.0**-25, 3.0e-8, 1e-6, 0.5, -1.0, 7.0, 0.0])
    got = ours([g], 1.0, False, floor=FLOOR)[0]
    assert_matches(got, np_stats(g, 1.0, False, floor=FLOOR))
    assert got["fp16_underflow"] == 0.0
    assert got["fp16_subnormal"] == pytest.approx(1 / 4)  # 1e-6 of 1e-6, 0.5, 1.0, 7.0
    assert got["negligible_frac"] == pytest.approx(4 / 9) and got["zero_frac"] == pytest.approx(1 / 9)
    assert got["min_nonzero"] == pytest.approx(1e-9)  # still the smallest non-zero entry
    # Without the floor the same entries count as underflow.
    assert ours([g], 1.0, False, floor=0.0)[0]["fp16_underflow"] == pytest.approx(3 / 8)


def test_the_floor_is_relative_to_the_largest_gradient_of_the_call() -> None:
    # A whole tensor of rounding residue (a conv bias before BatchNorm, an attention key bias) next to real
    # gradients: every entry is below 2**-24 of the largest, so none counts, whatever the loss scale.
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 64, generator=gen) * 1e-2
    residue = torch.randn(64, generator=gen) * 1e-11
    for scale, scaled in ((2.0**16, True), (1.0, False)):
        stored = [weight * scale, residue * scale] if scaled else [weight, residue]
        w, b = ours(stored, scale, scaled, floor=FLOOR)
        assert b["fp16_subnormal"] == 0.0 and b["fp16_underflow"] == 0.0 and b["negligible_frac"] == 1.0
        top = float(weight.abs().max())
        assert_matches(b, np_stats(stored[1], scale, scaled, top=top, floor=FLOOR))
        assert_matches(w, np_stats(stored[0], scale, scaled, top=top, floor=FLOOR))
    # Alone, the same tensor is its own reference: at scale 1 it is all signal, and all of it flushes in fp16.
    alone = ours([residue], 1.0, False, floor=FLOOR)[0]
    assert alone["fp16_underflow"] == 1.0 and alone["negligible_frac"] == 0.0


@pytest.mark.parametrize("sample", [None, 4])
def test_l2_does_not_overflow_float32_when_every_entry_is_finite(sample: int | None) -> None:
    # 1e3 * 2**60 ≈ 1.2e21 per entry is finite in float32, but its square (1.3e42) is not: the float32 sum of
    # squares is inf. The norm is taken over g / abs-max instead.
    g = torch.tensor([1e3, -2e3, 5e2, 0.0, 1e3, 3e3])
    s = 2.0**60
    want = float(g.double().norm())
    for counts in (True, False):
        stats = GradStats([6], sample=sample, counts=counts)
        row = stats.compute([g * s], torch.tensor(s), scaled=True).tolist()[0]
        assert math.isfinite(row[COL["l2"]])
        if sample is None:  # examined whole: exact
            assert row[COL["l2"]] == pytest.approx(want, rel=1e-6)
        else:  # estimated from 4 of 6 entries: between abs-max and sqrt(numel) * abs-max
            assert 3e3 <= row[COL["l2"]] <= 3e3 * math.sqrt(6)
    # an inf entry still makes it inf
    g[2] = math.inf
    assert math.isinf(GradStats([6]).compute([g], None).tolist()[0][COL["l2"]])


@pytest.mark.parametrize("floor", [0.0, FLOOR])
@pytest.mark.parametrize("scaled", [False, True])
def test_random_gradients_match_numpy(scaled: bool, floor: float) -> None:
    gen = torch.Generator().manual_seed(1)
    scale = 2.0**12
    grads = [
        torch.randn(7, 33, generator=gen) * 10.0 ** torch.randint(-12, 3, (7, 33), generator=gen),
        torch.randn(300, generator=gen) * 1e-9,
        torch.randn(5, 4, 3, generator=gen) * 50,
    ]
    grads[0][2] = 0.0
    grads[2][0, 0, 0] = math.inf
    grads[2][1, 1, 1] = math.nan
    top = max(float(g[torch.isfinite(g)].abs().max()) for g in grads)
    stored = [g * scale if scaled else g for g in grads]
    for got, g in zip(ours(stored, scale, scaled, floor=floor), stored):
        with np.errstate(invalid="ignore"):  # fp8 of the tensor with inf/NaN: |g| / inf
            want = np_stats(g, scale, scaled, top=top, floor=floor)
        if not math.isfinite(want["absmax"]):  # NaN present: abs-max and L2 are NaN
            assert math.isnan(got["absmax"]) and math.isnan(got["l2"])
            want = {k: v for k, v in want.items() if k not in ("absmax", "l2")}
        assert_matches(got, want)


def test_scaled_and_unscaled_reads_agree() -> None:
    g = torch.randn(50, generator=torch.Generator().manual_seed(2)) * 1e-6
    s = 2.0**14
    unscaled, scaled = ours([g], s, False)[0], ours([g * s], s, True)[0]
    for key in unscaled:
        assert unscaled[key] == pytest.approx(scaled[key], rel=1e-6), key


def test_low_precision_gradients() -> None:
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16):
        g = (torch.randn(64, generator=gen) * 1e-3).to(dtype)
        g[3] = 0
        got = ours([g], 1.0, False)[0]
        assert_matches(got, np_stats(g, 1.0, False))


def test_sampled_counts_and_exact_extremes_on_a_large_tensor() -> None:
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(200_000, generator=gen)
    g[::4] = 0.0  # 25% zeros
    g[1::8] *= 1e-12  # 1/8 of all entries, 1/6 of the non-zero ones, underflow fp16 at scale 1
    g[12345] = 3.0e-20
    g[777] = 1e5
    got = ours([g], 1.0, False, sample=4096)[0]
    want = np_stats(g, 1.0, False)
    assert got["sampled"] == 4096
    for key in ("absmax", "l2"):  # over every entry
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    assert want["min_nonzero"] <= got["min_nonzero"] < 1e-13  # the smallest of the sample: an upper bound
    assert got["zero_frac"] == pytest.approx(0.25, abs=0.03)
    assert got["fp16_underflow"] == pytest.approx(want["fp16_underflow"], abs=0.03)
    assert got["bf16_underflow"] == 0.0 and got["bf16_overflow"] == 0.0  # proven 0 by the extremes


def test_abs_max_proves_that_nothing_overflows() -> None:
    # The sample holds huge values, but the abs-max over all entries shows that none reaches a format's limit.
    g = torch.full((10_000,), 400.0)
    got = ours([g], 1.0, False, sample=16)[0]
    assert all(got[f"{f.name}_overflow"] == 0.0 for f in FORMATS)
    g[5000] = 1e6  # one entry, most likely outside the sample: still seen by abs-max
    got = ours([g], 1.0, False, sample=16)[0]
    assert got["absmax"] == 1e6


def test_a_nonfinite_entry_outside_the_sample_is_still_counted() -> None:
    g = torch.ones(100_000)
    g[54321] = math.inf
    got = ours([g], 1.0, False, sample=64)[0]
    assert math.isinf(got["absmax"]) and got["nonfinite"] >= 1


def test_missing_sparse_and_empty_gradients_are_marked() -> None:
    stats = GradStats([3, 4, 0])
    matrix = stats.compute([None, torch.ones(4), torch.ones(0)], None).tolist()
    assert [row[COL["has_grad"]] for row in matrix] == [0.0, 1.0, 0.0]
    assert len(matrix[0]) == len(COLUMNS)
    with pytest.raises(ValueError, match="expected 3 gradients"):
        stats.compute([None], None)


def test_compute_touches_neither_gradients_nor_the_global_rng() -> None:
    grads = [torch.randn(10_000), torch.randn(3, 3).half()]
    before = [g.clone() for g in grads]
    rng = torch.get_rng_state()
    GradStats([g.numel() for g in grads], sample=100).compute(grads, torch.tensor(8.0), scaled=True)
    assert all(torch.equal(a, b) for a, b in zip(before, grads))
    assert torch.equal(rng, torch.get_rng_state())


def test_norms_only_leaves_counts_out() -> None:
    g = torch.tensor([3.0, 4.0, 0.0])
    rows = GradStats([3], counts=False).compute([g], None).tolist()
    stats = rows_to_dicts(rows, ["w"])["w"]
    assert stats == {"absmax": 4.0, "l2": 5.0}


def test_all_zero_gradient() -> None:
    got = ours([torch.zeros(5)], 1.0, False)[0]
    assert got["min_nonzero"] == math.inf and got["zero_frac"] == 1.0 and got["fp16_underflow"] == 0.0


# ---- the hot path: ATen ops per sampled step, counted by a dispatch mode (deterministic, no timing) ---------------


def _grads(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(64, 32, generator=gen) for _ in range(n)] + [torch.randn(5000, generator=gen)]


# Pinned: the ops of one full-statistics compute of 4 float32 gradients on CPU (3 of 2048 entries, 1 of 5000, so
# examined whole and sampled), after the first call built the plan. Raise it only on purpose. (226 -> 216: on CPU
# the squares that replace an overflowed float32 L2 are summed only when one overflowed, and the non-finite code
# is made only when an abs-max is not finite: fewer ops over the examined entries, three more on the 4 rows; the
# examined entries are gathered in the same loop as the extremes, one reshape each. 216 -> 195: one joint
# histogram of every format, its entries' classes from sign() arithmetic instead of comparisons and where().
# 195 -> 209: a tensor examined whole has no dot and aminmax of its own any more (segment reductions over the
# examined entries, a constant number of ops: more on these 4 tensors, 34 x 3 fewer on the bench model's 54), and
# the buckets are integer subtractions of bit patterns instead of bucketize.)
OPS_PER_COMPUTE = 209


def test_the_ops_of_a_sampled_compute_are_pinned_and_there_is_no_bincount() -> None:
    stats = GradStats([g.numel() for g in _grads(3)], sample=4096)
    grads, scale = _grads(3), torch.tensor(1024.0)
    stats.compute(grads, scale, scaled=True)  # builds the plan and the buffers once
    with CountOps() as mode:
        stats.compute(grads, scale, scaled=True)
    assert "bincount" not in mode.ops  # bincount reads its largest bin on the host: a sync per call on CUDA
    assert sum(mode.ops.values()) == OPS_PER_COMPUTE, dict(mode.ops)


def _grown_ops(small: list[torch.Tensor], large: list[torch.Tensor]) -> dict[str, int]:
    """Return the ops one compute of ``large`` runs beyond one of ``small`` (after each built its plan)."""
    counts = []
    for grads in (small, large):
        stats = GradStats([g.numel() for g in grads], sample=4096)
        stats.compute(grads, None)
        with CountOps() as mode:
            stats.compute(grads, None)
        counts.append(mode.ops)
    return {op: counts[1][op] - counts[0].get(op, 0) for op in counts[1] if counts[1][op] != counts[0].get(op, 0)}


def test_ops_other_than_the_per_tensor_extremes_do_not_grow_with_the_number_of_tensors() -> None:
    # CPU: a tensor examined whole (these 64 x 32) costs one view into the examined entries; its abs-max and L2 are
    # segment reductions over them, batched
    grown = _grown_ops(_grads(3), _grads(23))
    assert grown and set(grown) <= {"view", "reshape", "_reshape_alias"}, grown
    # a tensor larger than sample: one BLAS dot and one aminmax (faster there than foreach kernels) and one gather
    # of its examined entries, besides its view
    gen = torch.Generator().manual_seed(1)
    large = [torch.randn(5000, generator=gen) for _ in range(5)]
    grown = _grown_ops(large[:1], large)
    assert {op: grown.pop(op, 0) for op in ("dot", "aminmax", "index_select")} == dict.fromkeys(
        ("dot", "aminmax", "index_select"), 4), grown
    assert set(grown) <= {"view", "reshape", "_reshape_alias"}, grown


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_full_compute_never_syncs_and_matches_cpu() -> None:
    grads = _grads(3) + [torch.tensor([0.0, float("inf"), 1.0]), torch.tensor([float("nan"), 2.0])]
    stats_cpu, stats_gpu = GradStats([g.numel() for g in grads]), GradStats([g.numel() for g in grads])
    want = stats_cpu.compute(grads, torch.tensor(1024.0), scaled=True)
    cuda = [g.cuda() for g in grads]
    scale = torch.tensor(1024.0, device="cuda")
    stats_gpu.compute(cuda, scale, scaled=True)  # the plan's index tensors are built (and copied) once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        got = stats_gpu.compute(cuda, scale, scaled=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=0, equal_nan=True)
