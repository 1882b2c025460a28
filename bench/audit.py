"""What the numerics audit costs: an audited step against a plain step of the same run, and nothing on the others.

    python bench/audit.py [--steps 4] [--threads 0] [--layers 4] [--seq 256]

Setup: a transformers ``LlamaForCausalLM`` from a tiny config (hidden 256, ``--layers`` layers, 4 heads, vocab
2048; fp32 parameters), batch 2 x ``--seq`` tokens, AdamW, in two loops: bf16 autocast, and fp16 autocast with
``torch.amp.GradScaler("cpu")``. For each loop, in one process and alternating, ``--steps`` steps of each variant:

  plain    ampdoctor.watch(every=1, audit="off"): the watch alone, every step sampled
  audited  ampdoctor.watch(every=1, audit="all"): the same, every step audited (each op re-run in fp32, each leaf
           module's output compared with an fp32 re-run)

Each variant runs in a process of its own. It prints, per loop: the median step time of each and their ratio (the
issue's bound: at most 4x), how far the process's peak resident memory (``VmHWM``) rose above its memory once the
model was built (the steps' activations and temporaries; the audit's copies: one op's inputs in fp32 at a time, and
a module's fp32 re-run) and their ratio, the largest error of the healthy
run in roundoff units (what ``GRADED_ULPS`` leaves a margin to), and the ATen ops of a step the default audit does
not audit, with the audit part attached and without (they must be equal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import ampdoctor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from op_count import CountOps  # noqa: E402  (tests/op_count.py: the suite's ATen op counter)


def _rss_kib(field: str) -> int:
    """This process's resident memory (``VmRSS``) or its peak so far (``VmHWM``), in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


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
    """Run one variant in a process of its own (its peak memory is its own) and return what it printed."""
    done = subprocess.run([sys.executable, __file__, "--child", audit, str(dtype).split(".")[-1],
                           "--steps", str(args.steps), "--layers", str(args.layers), "--seq", str(args.seq),
                           "--threads", str(args.threads)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(audit: str, dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    """One variant: the median step time, and how far above the memory after building the model the process's
    peak went (the steps' activations and temporaries, the audit's copies included)."""
    model, opt = build(args.layers)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    ids = torch.randint(0, 2048, (2, args.seq))
    base = _rss_kib("VmRSS")
    times = []
    with ampdoctor.watch(model, opt, scaler, every=1, dense=0, audit=audit) as w:
        step(model, opt, scaler, dtype, ids)   # warm-up (audited too)
        for _ in range(args.steps):
            start = time.perf_counter()
            step(model, opt, scaler, dtype, ids)
            times.append(time.perf_counter() - start)
    section = w.watch_summary().parts.get("audit")
    return {"time": statistics.median(times), "peak": (_rss_kib("VmHWM") - base) * 1024,
            "worst": section.worst[0].ulps if section is not None and section.worst else None,
            "audited": list(section.steps) if section is not None else [],
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
    parser.add_argument("--child", nargs=2, metavar=("AUDIT", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child[0], getattr(torch, args.child[1]), args)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny Llama, {args.layers} layers, "
          f"batch 2 x {args.seq}; {args.steps} timed steps each")
    for dtype in (torch.bfloat16, torch.float16):
        plain, audited = measure("off", dtype, args), measure("all", dtype, args)
        name = "bf16 autocast" if dtype == torch.bfloat16 else "fp16 autocast + GradScaler"
        print(f"{name}:")
        print(f"  step time      plain {plain['time'] * 1e3:8.1f} ms   audited {audited['time'] * 1e3:8.1f} ms   "
              f"ratio {audited['time'] / plain['time']:.2f}x")
        print(f"  peak MiB above the model  plain {plain['peak'] / 2**20:6.1f}   "
              f"audited {audited['peak'] / 2**20:6.1f}   ratio {audited['peak'] / max(plain['peak'], 1):.2f}x")
        print(f"  audited steps {audited['audited']}; largest error of the healthy run: {audited['worst']:.2f} "
              f"roundoff units; audit findings: {', '.join(audited['findings']) or 'none'}")
        off, auto = unaudited_ops("off", dtype, args), unaudited_ops("auto", dtype, args)
        print(f"  ATen ops of an unaudited step: audit off {off}, audit auto {auto} "
              f"({'equal' if off == auto else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
