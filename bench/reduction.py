"""Bytes and time of the per-sampled-step merge of sharded gradient statistics, against the number of parameters.

    python bench/reduction.py [--sizes 10 100 1000 10000 100000] [--repeats 20]

Two gloo ranks on the CPU (``torch.multiprocessing.spawn``, FileStore). For each number of parameter rows ``N``,
every row sharded over the world group, it times ``ShardReduction.exchange`` (one MAX all-reduce of 4 float64
columns before the counts, one SUM all-reduce of 19 after them: ``23 * 8 = 184`` bytes per row) with a trivial
``finish``, and prints the bytes each rank sends into the collectives and the median time. Ratios are against a
baseline measured in the same run: one all-reduce of a single float64, the floor any per-step collective pays
(what DTensor's found-inf reduction costs a GradScaler step under FSDP2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def _worker(rank: int, world: int, store: str, sizes: list[int], repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ampdoctor.monitor.grad_stats import COL, COLUMNS
    from ampdoctor.monitor.reduction import ShardReduction

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    group = dist.group.WORLD

    def timed(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    one = torch.zeros(1, dtype=torch.float64)
    rows_out = [("baseline: one float64 all-reduce", 0, 8, timed(lambda: dist.all_reduce(one)))]
    for n in sizes:
        reduction = ShardReduction([("sharded", (group,))] * n, [1000] * n, counts=True)
        gen = torch.Generator().manual_seed(rank)
        rows = torch.rand(n, len(COLUMNS), generator=gen, dtype=torch.float64)
        rows[:, COL["has_grad"]] = 1.0
        seconds = timed(lambda: reduction.exchange(rows, lambda absmax: rows))
        per_step = reduction.bytes // (reduction.collectives // 2)
        rows_out.append((f"{n} parameters", n, per_step, seconds))
    if rank == 0:
        with open(out, "w") as f:
            for label, n, nbytes, seconds in rows_out:
                f.write(f"{label}\t{n}\t{nbytes}\t{seconds}\n")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 10000, 100000])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "result.tsv")
    started = time.perf_counter()
    mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), args.sizes, args.repeats, out), nprocs=2, join=True)
    lines = [line.rstrip("\n").split("\t") for line in open(out)]
    base = float(lines[0][3])
    print(f"{'rows merged':34s} {'bytes/rank':>12s} {'median':>10s} {'x baseline':>10s} {'per row':>9s}")
    for label, n, nbytes, seconds in lines:
        n, nbytes, seconds = int(n), int(nbytes), float(seconds)
        per_row = f"{seconds / n * 1e6:7.2f} µs" if n else f"{'-':>9s}"
        print(f"{label:34s} {nbytes:12,d} {seconds * 1e3:7.3f} ms {seconds / base:9.1f}x {per_row}")
    print(f"\n2 gloo ranks on CPU, {args.repeats} repeats (median); total {time.perf_counter() - started:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
