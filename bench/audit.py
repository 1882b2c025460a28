"""What the numerics audit costs: an audited step against a plain step of the same run, and nothing on the others.

    python bench/audit.py [--steps 4] [--threads 0] [--layers 4] [--seq 256]

Setup: a transformers ``LlamaForCausalLM`` from a tiny config (hidden 256, ``--layers`` layers, 4 heads, vocab
2048; fp32 parameters), batch 2 x ``--seq`` tokens, AdamW, in two loops: bf16 autocast, and fp16 autocast with
``torch.amp.GradScaler("cpu")``. For each loop, in one process and alternating, ``--steps`` steps of each variant:

  plain    ampdoctor.watch(every=1, audit="off"): the watch alone, every step sampled
  audited  ampdoctor.watch(every=1, audit="all"): the same, every step audited (each op re-run in fp32, each leaf
           module's output compared with an fp32 re-run)

It prints, per loop: the median step time of each and their ratio (the issue's bound: at most 4x), the peak of the
tensor bytes alive during a step (counted by a dispatch mode below the audit's, so the audit's own copies count:
one op's inputs in fp32 at a time, plus the leaf module re-run) and their ratio, the largest error of the healthy
run in roundoff units (what ``GRADED_ULPS`` leaves a margin to), and the ATen ops of a step the default audit does
not audit, with the audit part attached and without (they must be equal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampdoctor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from op_count import CountOps  # noqa: E402  (tests/op_count.py: the suite's ATen op counter)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of the tensors the ops inside it create, while they are alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t._is_view() and id(t) not in self._seen:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                self._seen.add(id(t))
                weakref.finalize(t, self._freed, id(t), nbytes)
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)


def build(layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: Any, opt: Any, scaler: Any, dtype: torch.dtype, ids: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=dtype):
        loss = model(input_ids=ids, labels=ids).loss
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad()


def measure(audit: str, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    model, opt = build(args.layers)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    ids = torch.randint(0, 2048, (2, args.seq))
    times, peaks = [], []
    with ampdoctor.watch(model, opt, scaler, every=1, dense=0, audit=audit) as w:
        step(model, opt, scaler, dtype, ids)   # warm-up (audited too)
        for _ in range(args.steps):
            with LiveBytes() as live:
                start = time.perf_counter()
                step(model, opt, scaler, dtype, ids)
                times.append(time.perf_counter() - start)
            peaks.append(live.peak)
    section = w.watch_summary().parts.get("audit")
    worst = section.worst[0].ulps if section is not None and section.worst else None
    return {"time": statistics.median(times), "peak": max(peaks), "worst": worst,
            "findings": [f.code for f in w.findings() if f.severity.value in ("error", "warning")]}


def unaudited_ops(audit: str, dtype: torch.dtype, args: argparse.Namespace) -> int:
    """The ATen ops of step 3 of a default-sampled run (steps 0 and 1 are the default audit's)."""
    model, opt = build(args.layers)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    ids = torch.randint(0, 2048, (2, args.seq))
    with ampdoctor.watch(model, opt, scaler, every=50, dense=0, audit=audit):
        for i in range(4):
            with CountOps() as counter:
                step(model, opt, scaler, dtype, ids)
    return sum(counter.ops.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny Llama, {args.layers} layers, "
          f"batch 2 x {args.seq}; {args.steps} timed steps each")
    for dtype in (torch.bfloat16, torch.float16):
        plain, audited = measure("off", dtype, args), measure("all", dtype, args)
        name = "bf16 autocast" if dtype == torch.bfloat16 else "fp16 autocast + GradScaler"
        print(f"{name}:")
        print(f"  step time      plain {plain['time'] * 1e3:8.1f} ms   audited {audited['time'] * 1e3:8.1f} ms   "
              f"ratio {audited['time'] / plain['time']:.2f}x")
        print(f"  peak live MiB  plain {plain['peak'] / 2**20:8.1f}      audited {audited['peak'] / 2**20:8.1f}      "
              f"ratio {audited['peak'] / plain['peak']:.2f}x")
        print(f"  largest error of the healthy run: {audited['worst']:.2f} roundoff units; audit findings: "
              f"{', '.join(audited['findings']) or 'none'}")
        off, auto = unaudited_ops("off", dtype, args), unaudited_ops("auto", dtype, args)
        print(f"  ATen ops of an unaudited step: audit off {off}, audit auto {auto} "
              f"({'equal' if off == auto else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
