"""How ampdoctor's costs grow with the number of parameter tensors, from 10 to 100,000, on CPU.

    python bench/scaling.py [--sizes 10,100,1000,10000,100000] [--reps 3] [--threads 2]

Model: ``nn.ParameterList`` of N one-entry fp32 parameters (``torch.zeros(1)``), forward ``(cat(params) * x).sum()``
under fp16 autocast, ``torch.amp.GradScaler("cpu")`` and foreach SGD. Every parameter is its own tensor, so every
per-tensor cost of ampdoctor shows and nothing else grows: the worst case for bookkeeping.

Measured, per N (``gc`` off while timing, as ``timeit`` does; medians):

  pre-flight   ``ampdoctor.check(model, opt, scaler, autocast_dtype=fp16)``, best of ``--reps``.
  plain step   one whole training step without ampdoctor: the baseline of the ratios.
  bookkeeping  what a monitor adds to the part of the step it hooks: ``scaler.scale(loss)``, ``scaler.step(opt)``
               and ``scaler.update()`` (every observer and optimizer hook of the watch and the guard runs inside
               these calls; forward and backward carry no ampdoctor hook without activations=True). Timed as
               median(monitored) - median(plain), the two interleaved rep by rep so drift hits both alike:
                 watch norms     ``watch(every=1, stats="norms")``: a sampled step, extremes of every gradient
                 watch full      ``watch(every=1, stats="full")``: a sampled step, also the sampled counts
                 watch unsampled ``watch(every=1000)``: a step between two samples
                 guard           ``ScalerGuard``: the GradScaler state-machine observers (``ampdoctor run``)

A sampled step at 50k tensors or more is timed once (it costs seconds, far above the noise); the rest
``--reps`` times. "~0" marks a difference within the spread of the plain timings. Per-tensor columns divide by
N; "x step" divides by the plain step. The last lines fit the log-log slope of each
cost from the two largest sizes: 1 is linear, 0 constant, 2 quadratic. Exits 1 when a cost grows faster than
N**1.5 between the two largest sizes, so a quadratic regression fails loudly. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

import ampdoctor
from ampdoctor.core.training import TrainingSetup
from ampdoctor.guard.scaler_guard import ScalerGuard


class ManyTensors(nn.Module):
    """N parameters of one entry each."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.cat(list(self.params)) * x).sum()


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    gc.disable()  # collected once per size in measure(): a full collection here costs ~0.2 s
    try:
        yield
    finally:
        gc.enable()


class Loop:
    def __init__(self, n: int) -> None:
        torch.manual_seed(0)
        self.model = ManyTensors(n)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, foreach=True)
        self.scaler = torch.amp.GradScaler("cpu")
        self.x = torch.randn(n)

    def step(self) -> tuple[float, float]:
        """Run one step; return (whole step, the hooked part) in seconds."""
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = self.model(self.x)
        self.opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        scaled = self.scaler.scale(loss)
        hooked = time.perf_counter() - t0
        scaled.backward()
        t0 = time.perf_counter()
        self.scaler.step(self.opt)
        self.scaler.update()
        end = time.perf_counter()
        return end - start, hooked + end - t0


def overhead(loop: Loop, attach: Callable[[Loop], Any], reps: int) -> tuple[float, float]:
    """Return median(hooked part with the monitor) - median(without), interleaved, each attach warmed up by one
    step; and the noise: the spread (max - min) of the plain timings."""
    plain, watched = [], []
    loop.step()
    for _ in range(reps):
        with no_gc():
            plain.append(loop.step()[1])
        monitor = attach(loop)
        try:
            loop.step()  # warm-up: first-step allocations (gather plans, buffers, setup scans)
            with no_gc():
                watched.append(loop.step()[1])
        finally:
            monitor.detach()
    return statistics.median(watched) - statistics.median(plain), max(plain) - min(plain)


def measure(n: int, reps: int, full_max: int) -> dict[str, float]:
    gc.collect()
    loop = Loop(n)
    row: dict[str, float] = {"n": n}
    times = []
    for _ in range(reps):
        with no_gc():
            start = time.perf_counter()
            ampdoctor.check(loop.model, loop.opt, loop.scaler, autocast_dtype=torch.float16)
            times.append(time.perf_counter() - start)
    row["check"] = min(times)
    loop.step()
    steps = []
    for _ in range(reps):
        with no_gc():
            steps.append(loop.step()[0])
    row["step"] = statistics.median(steps)
    # a sampled step costs seconds at 100k tensors, far above the noise: one rep there keeps the total in budget
    sampled_reps = reps if n < 50_000 else 1
    row["norms"], row["norms_noise"] = overhead(
        loop, lambda loop: ampdoctor.watch(loop.model, loop.opt, loop.scaler, every=1, stats="norms"), sampled_reps)
    if n <= full_max:
        row["full"], row["full_noise"] = overhead(
            loop, lambda loop: ampdoctor.watch(loop.model, loop.opt, loop.scaler, every=1, stats="full"), sampled_reps)
    row["unsampled"], row["unsampled_noise"] = overhead(loop, _unsampled, reps)
    setup = TrainingSetup(loop.model, loop.opt, loop.scaler, torch.float16)
    row["guard"], row["guard_noise"] = overhead(loop, lambda loop: ScalerGuard(loop.scaler, setup).attach(), reps)
    return row


def _unsampled(loop: Loop) -> Any:
    # every=1000, not 10**9: the ScaleMonitor preallocates `every` rows (10**9 rows = 8 GB; see
    # tests/harm/test_absurd_inputs.py::test_watch_with_a_huge_every_allocates_nothing_huge)
    w = ampdoctor.watch(loop.model, loop.opt, loop.scaler, every=1000, stats="full")
    loop.step()  # step 0 is the sampled one; the measured steps are not
    return w


COSTS = [("check", "pre-flight check()"), ("norms", "watch sampled, norms"), ("full", "watch sampled, full"),
         ("unsampled", "watch unsampled"), ("guard", "ScalerGuard")]


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.1f} ms" if abs(seconds) < 1 else f"{seconds:.2f} s"


def render(rows: list[dict[str, float]]) -> list[str]:
    lines = []
    header = f"{'tensors':>8} {'plain step':>10} │ " + " │ ".join(f"{title:^28}" for _, title in COSTS)
    lines.append(header)
    lines.append(f"{'':>8} {'':>10} │ " + " │ ".join(f"{'time':>9} {'per tensor':>10} {'x step':>7}"
                                                          for _ in COSTS))
    for row in rows:
        cells = []
        for key, _ in COSTS:
            value = row.get(key)
            if value is None:
                cells.append(f"{'-':>9} {'-':>10} {'-':>7}")
            elif _below_noise(row, key):
                cells.append(f"{'~0':>9} {'':>10} {'':>7}")
            else:
                cells.append(f"{_fmt(value):>9} {_fmt(value / row['n']):>10} {value / row['step']:>7.3f}")
        lines.append(f"{int(row['n']):>8} {_fmt(row['step']):>10} │ " + " │ ".join(cells))
    return lines


def _below_noise(row: dict[str, float], key: str) -> bool:
    return abs(row[key]) <= row.get(f"{key}_noise", 0.0)


def noise_lines(rows: list[dict[str, float]]) -> list[str]:
    out = []
    for key, title in COSTS:
        quiet = [r for r in rows if r.get(key) is not None and _below_noise(r, key)]
        if quiet:
            out.append(f"  {title}: below the timing noise at " + ", ".join(
                f"{int(r['n'])} ({_fmt(r[key])} vs spread {_fmt(r[key + '_noise'])})" for r in quiet))
    return out


def slopes(rows: list[dict[str, float]]) -> tuple[list[str], bool]:
    """Log-log slope of each cost between the two largest sizes that have it; a slope above 1.5 fails."""
    lines, ok = [], True
    for key, title in COSTS + [("step", "plain step")]:
        have = [r for r in rows if r.get(key) is not None]
        if len(have) < 2:
            continue
        a, b = have[-2], have[-1]
        if _below_noise(b, key):
            lines.append(f"  {title:<22} {int(a['n']):>6} -> {int(b['n']):<6} tensors: below noise (constant)")
            continue
        # a smaller point within the noise counts as the noise: the slope is then an upper bound
        va, vb = max(a[key], a.get(f"{key}_noise", 0.0), 1e-5), max(b[key], 1e-5)
        slope = math.log(vb / va) / math.log(b["n"] / a["n"])
        verdict = "constant" if slope < 0.3 else "linear" if slope < 1.3 else "superlinear" if slope < 1.5 else \
            "QUADRATIC-LIKE"
        ok &= slope < 1.5
        lines.append(f"  {title:<22} {int(a['n']):>6} -> {int(b['n']):<6} tensors: slope {slope:5.2f} ({verdict})")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,1000,10000,100000")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--full-max", type=int, default=100_000, help="largest N for stats='full'")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    started = time.perf_counter()
    print(f"torch {torch.__version__}, ampdoctor {ampdoctor.__version__}, {torch.get_num_threads()} threads, "
          f"reps {args.reps}", flush=True)
    rows = []
    for n in sizes:
        t0 = time.perf_counter()
        rows.append(measure(n, args.reps, args.full_max))
        print(f"  measured {n} tensors in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print("\n".join(render(rows)))
    quiet = noise_lines(rows)
    if quiet:
        print("~0: |monitored - plain| within the spread of the plain timings (constant cost, too small to see):")
        print("\n".join(quiet))
    lines, ok = slopes(rows)
    print("growth between the two largest sizes (log-log slope; 0 constant, 1 linear, 2 quadratic):")
    print("\n".join(lines))
    print(f"total {time.perf_counter() - started:.0f} s; " + ("every cost grows at most linearly" if ok else
                                                          "a cost grows faster than linearly"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
