"""Step-time overhead of gradient/activation monitoring on a ~10M-parameter transformer, on CPU.

    python bench/overhead.py [--rounds 6] [--steps 5] [--threads 0] [--autocast float16|bfloat16]

Setup: a 4-layer ``nn.TransformerEncoder`` LM (d_model 320, 5 heads, ff 1280, vocab 8192; 10.2M parameters,
54 tensors), batch 4 x 64 tokens, fp32 parameters, fp16 autocast, ``torch.amp.GradScaler("cpu")`` and fused
AdamW: the fp16 AMP loop ampdoctor is about, with the scaler in it (so the loss-scale observers and the scaled-grad
read are measured too). On CPUs with AVX512-FP16/AMX, fp16 and bf16 autocast steps cost about the same.

Variants, each timed in blocks of ``--steps`` steps (after one warm-up step), each block right after a block of the
unmonitored baseline, round after round (the order reverses every other round). Two ratios are printed: the median
over rounds of median(variant block) / median(its baseline block), so that slow drift of a shared machine hits both
alike (for (g), the mean of its 10 steps over its baseline block's mean), and best variant step / best baseline
step, the least disturbed estimate when other processes compete for the two cores (the difference between the two
says how noisy the run was). For (a), (c), (d), (f) and (g) a third, "inside" ratio adds the time measured inside
the monitoring code per step (``Watch.seconds_inside``: the statistics, the ends of steps, the lost-update hooks and
the activation monitor's forward hooks; the print loop's and the norm's own duration) to the baseline's median
step: it is not a difference of two noisy numbers, but it misses indirect costs (caches, allocator) and
ampdoctor's O(1) per-step observers:

  (a) the seed's loop: print(name, grad.abs().max().item(), grad.norm().item()) per parameter, to /dev/null
  (b) transformers' DebugUnderflowOverflow(model) (forward hooks with .item() checks on every module)
  (c) ampdoctor.watch(every=1, stats="full") with a flight recorder: every statistic at every step
  (d) ampdoctor.watch() at its default sampling (every=50, the first 10 steps dense, escalation after trouble), with a
      flight recorder. Each block attaches a fresh watch, so its timed steps are the steady state (``dense=0``);
      the dense start is then amortized over a RUN_STEPS-step run, and one sampled step over every 50
  (e) ampdoctor's ActivationMonitor at every step
  (f) the floor: one torch._foreach_norm over all gradients per step (a pass over every entry, nothing recorded)
  (g) ampdoctor.watch() at its defaults over its dense start: each block attaches a fresh watch and times its first
      DENSE_STEPS steps (all sampled, the activation monitor armed for them), step 0 included

Host syncs are counted by ampdoctor itself (``Watch.host_syncs``: one ``.tolist()`` per sampled step); the activation
monitor's ``step_record`` makes one more ``.tolist()`` per sampled step (its ``_abs_max``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

import ampdoctor
from ampdoctor.monitor.activations import ActivationMonitor
from ampdoctor.monitor.sampling import DENSE_STEPS

VOCAB, D_MODEL, LAYERS, HEADS, FF, BATCH, SEQ = 8192, 320, 4, 5, 1280, 4, 64


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(SEQ, D_MODEL))
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]])))


class Loop:
    """One model, optimizer and scaler shared by every variant; ``step(after_backward)`` runs one AMP step."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        torch.manual_seed(0)
        self.dtype = dtype
        self.model = TinyLM()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.scaler = torch.amp.GradScaler("cpu")
        gen = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(8)]
        self.i = 0

    def step(self, after_backward: Callable[[], None] | None = None) -> float:
        tokens = self.batches[self.i % len(self.batches)]
        self.i += 1
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=self.dtype):
            logits = self.model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        self.scaler.scale(loss).backward()
        if after_backward is not None:
            after_backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start


# ---- variants: each is a context manager that attaches and detaches one kind of monitoring ---------------------
# It yields (after_backward, inside): a callable run between backward and scaler.step (or None), and a callable
# returning the seconds spent so far inside the monitoring code (or None when that cannot be told apart).
@contextlib.contextmanager
def baseline(loop: Loop, stats: dict[str, Any]):
    yield None, None


@contextlib.contextmanager
def seed_print_loop(loop: Loop, stats: dict[str, Any]):
    devnull = open(os.devnull, "w")
    spent = [0.0]

    def show() -> None:
        start = time.perf_counter()
        for name, p in loop.model.named_parameters():
            print(name, p.grad.abs().max().item(), p.grad.norm().item(), file=devnull)
        spent[0] += time.perf_counter() - start

    try:
        yield show, lambda: spent[0]
    finally:
        devnull.close()


@contextlib.contextmanager
def debug_underflow_overflow(loop: Loop, stats: dict[str, Any]):
    from transformers.debug_utils import DebugUnderflowOverflow

    before = {id(m): set(m._forward_hooks) for m in loop.model.modules()}
    DebugUnderflowOverflow(loop.model)  # registers forward hooks on every module; it has no detach
    try:
        yield None, None
    finally:
        for m in loop.model.modules():
            for key in set(m._forward_hooks) - before[id(m)]:
                del m._forward_hooks[key]


def ampdoctor_watch(every: int, dense: int):
    @contextlib.contextmanager
    def variant(loop: Loop, stats: dict[str, Any]):
        with tempfile.TemporaryDirectory() as log_dir:
            w = ampdoctor.watch(loop.model, loop.opt, loop.scaler, every=every, log_dir=log_dir, stats="full",
                                dense=dense)
            try:
                yield None, lambda: w.seconds_inside
            finally:
                w.detach()  # flushes the loss scales of the steps after the last sampled one: one more sync
                stats["sampled"] = stats.get("sampled", 0) + w.sampled_steps
                stats["syncs"] = stats.get("syncs", 0) + w.host_syncs
                stats["steps"] = stats.get("steps", 0) + w.steps
                stats["off"] = w.summary_data()["off"]
    return variant


@contextlib.contextmanager
def foreach_floor(loop: Loop, stats: dict[str, Any]):
    spent = [0.0]
    params = list(loop.model.parameters())

    def norms() -> None:
        start = time.perf_counter()
        torch._foreach_norm([p.grad for p in params])
        spent[0] += time.perf_counter() - start

    yield norms, lambda: spent[0]


@contextlib.contextmanager
def activation_monitor(loop: Loop, stats: dict[str, Any]):
    monitor = ActivationMonitor(loop.model, every=1)
    with monitor:
        yield None, None
    stats["sampled"] = stats.get("sampled", 0) + monitor.summary()["sampled_steps"]


BASE, SEED, DUO, FULL, DEFAULT, ACTIVATIONS, FLOOR, DENSE = (
    "baseline (no monitoring)", "(a) seed per-param print loop", "(b) transformers DebugUnderflowOverflow",
    "(c) ampdoctor watch, full stats every step", "(d) ampdoctor watch, default every=50",
    "(e) ampdoctor ActivationMonitor every step", "(f) floor: one torch._foreach_norm",
    "(g) ampdoctor watch, defaults, dense start")
VARIANTS = {BASE: baseline, SEED: seed_print_loop, DUO: debug_underflow_overflow, FULL: ampdoctor_watch(1, 0),
            DEFAULT: ampdoctor_watch(50, 0), ACTIVATIONS: activation_monitor, FLOOR: foreach_floor,
            DENSE: ampdoctor_watch(50, DENSE_STEPS)}
FROM_ATTACH = {DENSE}  # variants timed from their first step after attach, for DENSE_STEPS steps
RUN_STEPS = 1000  # the run length over which (d)'s dense first steps are amortized


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loop = Loop(getattr(torch, args.autocast))
    n_params = sum(p.numel() for p in loop.model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters in {len(list(loop.model.parameters()))} tensors; batch "
          f"{BATCH}x{SEQ}; {args.autocast} autocast + GradScaler('cpu') + fused AdamW; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for _ in range(3):
        loop.step()  # warm-up: allocator, autocast caches
    started = time.perf_counter()
    times, paired, inside, extra = _timed_rounds(loop, args.rounds, args.steps, started)
    _print_results(loop, times, paired, inside, extra)
    print(f"\n{args.rounds} rounds x {args.steps} timed steps per variant; total {time.perf_counter() - started:.0f} s")
    return 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--autocast", choices=("float16", "bfloat16"), default="float16",
                        help="autocast dtype; bfloat16 on a CPU with fast bf16 and slow fp16 matmuls (AVX512-BF16 "
                             "without AVX512-FP16) gives a realistic step time. The GradScaler stays, so the same "
                             "monitoring code runs; the watch's work is on the fp32 gradients either way")
    return parser.parse_args(argv)


def _timed_rounds(loop: Loop, rounds: int, steps: int, started: float) -> tuple[
        dict[str, list[float]], dict[str, list[float]], dict[str, float], dict[str, dict[str, Any]]]:
    """Time every variant in blocks of ``steps``, each right after a baseline block, for ``rounds`` rounds; return
    each variant's step times, its ratios to the paired baseline blocks, its time inside monitoring and its stats."""
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    paired: dict[str, list[float]] = {name: [] for name in VARIANTS}
    inside: dict[str, float] = {name: 0.0 for name in VARIANTS}
    extra: dict[str, dict[str, Any]] = {name: {} for name in VARIANTS}
    for r in range(rounds):
        order = list(VARIANTS)[1:]
        if r % 2:
            order.reverse()
        for name in order:
            blocks = []
            dense = name in FROM_ATTACH  # the watch's first DENSE_STEPS steps, step 0 included
            for current in (BASE, name):
                with VARIANTS[current](loop, extra[current]) as (hook, spent):
                    if not dense:
                        loop.step(hook)  # warm-up step of this block (step 0 is sampled: not timed)
                    before = spent() if spent else 0.0
                    block = [loop.step(hook) for _ in range(DENSE_STEPS if dense else steps)]
                    inside[current] += (spent() - before) if spent else 0.0
                times[current] += block
                # the dense start is the run's first steps as a whole: their mean, not a typical one of them
                blocks.append(statistics.fmean(block) if dense else statistics.median(block))
            paired[name].append(blocks[1] / blocks[0])
        print(f"  round {r + 1}/{rounds} done after {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return times, paired, inside, extra


def _print_results(loop: Loop, times: dict[str, list[float]], paired: dict[str, list[float]],
                   inside: dict[str, float], extra: dict[str, dict[str, Any]]) -> None:
    """Print each variant's median and best step, its paired and best ratios, its inside ratio, and notes."""
    best_base, median_base = min(times[BASE]), statistics.median(times[BASE])
    per_step = {name: inside[name] / max(len(times[name]), 1) for name in VARIANTS}
    # (d)'s timed steps are never sampled: amortize one sampled step, as measured in (c), over 50, and the dense
    # start (DENSE_STEPS sampled steps) over a RUN_STEPS-step run
    per_step[DEFAULT] += per_step[FULL] / 50 + per_step[FULL] * DENSE_STEPS / RUN_STEPS
    print(f"\n{'variant':46s} {'median':>9s} {'best':>9s} {'ratio':>6s} {'best':>6s} {'inside':>7s}  notes")
    print(f"{'':46s} {'step':>9s} {'step':>9s} {'paired':>6s} {'ratio':>6s} {'ratio':>7s}")
    for name, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        ratio = statistics.median(paired[name]) if paired[name] else 1.0
        measured = name in (SEED, FULL, DEFAULT, FLOOR, DENSE)
        inside_ratio = f"{1 + per_step[name] / median_base:6.3f}x" if measured else f"{'-':>7s}"
        note = _note(name, extra[name], per_step[name], len(list(loop.model.parameters())), DENSE_STEPS)
        print(f"{name:46s} {med * 1000:6.1f} ms {best * 1000:6.1f} ms {ratio:5.2f}x {best / best_base:5.2f}x "
              f"{inside_ratio}  {note}")


def _note(name: str, info: dict[str, Any], per_step: float, tensors: int, dense_steps: int) -> str:
    """Return what a variant's row notes: its host syncs and its time inside monitoring per step."""
    if "syncs" in info:
        note = (f"{info['syncs']} host syncs = {info['sampled']} sampled steps (of {info['steps']}) + "
                f"{info['syncs'] - info['sampled']} detach flushes; {per_step * 1000:.2f} ms inside/step")
        if name == DEFAULT:
            note += f" (1 sampled step in 50 and the first {dense_steps} of {RUN_STEPS}, amortized)"
        if name == DENSE:
            note += f" (the first {dense_steps} steps of each watch, all sampled, step 0 included)"
        if info.get("off"):
            note += f"; parts off: {info['off']}"
        return note
    if name == ACTIVATIONS:
        return f"{info.get('sampled', 0)} sampled steps, 1 host sync each (its step_record)"
    if name == SEED:
        return f"{2 * tensors} .item() syncs per step; {per_step * 1000:.2f} ms inside/step"
    if name == FLOOR:
        return f"one pass over every gradient entry, no sync; {per_step * 1000:.2f} ms inside/step"
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
