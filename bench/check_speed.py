"""Time `ampdoctor.check()` against a plain pass over the parameters, at 10 to 100,000 parameter tensors.

Usage: python bench/check_speed.py

Half of the tensors are float16 under an enabled GradScaler("cpu") and AdamW, so AMP101 and AMP104 fire and the
rules do their full work (grouping, naming, bounding the output). Each size prints the median of several runs of
`check()` and of the baseline `list(model.named_parameters())`, and their ratio; time per tensor should stay flat.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import torch
from torch import nn

from ampdoctor.preflight.engine import check


def linear_model(tensors: int) -> nn.Module:
    """Return ``tensors // 2`` Linear(4, 4) layers (a weight and a bias each), every other one float16."""
    model = nn.ModuleList(nn.Linear(4, 4) for _ in range(tensors // 2))
    for layer in model[::2]:
        layer.half()
    return model


def tiny_param_model(tensors: int) -> nn.Module:
    """Return ``tensors`` one-element parameters in 1,000 ParameterLists, every other one float16."""
    per_list = 1000
    lists = []
    for start in range(0, tensors, per_list):
        lists.append(nn.ParameterList(
            nn.Parameter(torch.zeros(1, dtype=torch.float16 if i % 2 else torch.float32))
            for i in range(start, min(start + per_list, tensors))))
    return nn.ModuleList(lists)


def median_seconds(fn: Callable[[], object], runs: int) -> float:
    timings = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def measure(label: str, model: nn.Module, runs: int) -> None:
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    tensors = sum(1 for _ in model.parameters())
    report = check(model, opt, scaler, autocast_dtype=torch.float16)  # warm-up, and the findings to show
    checked = median_seconds(lambda: check(model, opt, scaler, autocast_dtype=torch.float16), runs)
    baseline = median_seconds(lambda: list(model.named_parameters()), runs)
    print(f"{label:<28} {tensors:>8,} tensors  check {checked * 1e3:9.2f} ms  "
          f"({checked / tensors * 1e6:5.2f} µs/tensor)  named_parameters {baseline * 1e3:8.2f} ms  "
          f"ratio {checked / baseline:5.1f}x  findings {len(report.findings)} {report.codes()}")


def main() -> int:
    started = time.perf_counter()
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}; median of runs, after one warm-up")
    for tensors, runs in ((10, 15), (1_000, 9), (10_000, 7)):
        measure("Linear(4, 4) layers", linear_model(tensors), runs)
    for tensors, runs in ((10, 15), (1_000, 9), (10_000, 7), (100_000, 3)):
        measure("Parameter(torch.zeros(1))", tiny_param_model(tensors), runs)
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
