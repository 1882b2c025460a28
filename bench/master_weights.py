"""Measure what MasterWeights costs: optimizer step time and bytes per parameter.

Run: ``python bench/master_weights.py [--threads N]`` (about 15 s). One intra-op thread by default: on a shared
machine, a second thread waiting for a core that another process holds stalls every op and swamps what is measured.

* Step time: ``MasterWeights(AdamW)`` over an fp16 model against plain ``AdamW`` over the same model in fp32, both
  measured in this run, for the default, foreach and fused AdamW. The MasterWeights step includes both phase
  changes: half gradients to fp32 (what the end of backward does) and fp32 masters back to the half copies.
* Bytes per parameter, counted from the real tensors (``untyped_storage().nbytes()``, each storage once): weights,
  fp32 masters, gradients and optimizer state after backward, and the total between steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))  # run from a checkout

from ampdoctor.repairs.master_weights import MasterWeights  # noqa: E402

WIDTH, DEPTH = 1024, 4  # 4 x (1024*1024 + 1024) ≈ 4.2 M parameters
WARMUP, REPEATS = 5, 31
MEMORY_WIDTH = 256  # bytes per parameter do not depend on size; a small model keeps the fp16 CPU forward quick


def make_model(dtype: torch.dtype, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(DEPTH) for m in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*layers[:-1]).to(dtype)


def _step_timer(model: nn.Module, opt: torch.optim.Optimizer, grad_dtype: torch.dtype):
    """Return a function that hands out fresh gradients, then runs opt.step() + opt.zero_grad().

    It returns (seconds to make the gradients, seconds of step + zero_grad). Making them stands for what backward
    spends on allocating gradients in the parameter's dtype: fp32 for the baseline, half under MasterWeights.
    """
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).to(grad_dtype) * 1e-3
             for i, p in enumerate(model.parameters())]

    def one_step() -> tuple[float, float]:
        start = time.perf_counter()
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        middle = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return middle - start, time.perf_counter() - middle

    return one_step


def time_pair(**adamw: object) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Return _step_timer samples of (AdamW on fp32 params, MasterWeights(AdamW) on fp16 params), after warmup.

    The two alternate step by step, so load from other processes falls on both alike.
    """
    fp32_model, half_model = make_model(torch.float32), make_model(torch.float16)
    baseline = _step_timer(fp32_model, torch.optim.AdamW(fp32_model.parameters(), lr=1e-4, **adamw), torch.float32)
    with MasterWeights(torch.optim.AdamW(half_model.parameters(), lr=1e-4, **adamw)) as opt:
        wrapped = _step_timer(half_model, opt, torch.float16)
        samples = [(baseline(), wrapped()) for _ in range(WARMUP + REPEATS)][WARMUP:]
    return [s[0] for s in samples], [s[1] for s in samples]


def time_phase_changes() -> tuple[float, float]:
    """Return median seconds of MasterWeights' two phase changes alone, with no optimizer work in between.

    half -> fp32 allocates the fp32 gradients and converts the half ones; fp32 -> half copies the masters into the
    half weights. (Private methods: this is the breakdown of the step overhead measured above.)
    """
    model = make_model(torch.float16)
    grads = [torch.randn(p.shape, dtype=torch.float16) for p in model.parameters()]
    to_update, to_compute = [], []
    with MasterWeights(torch.optim.AdamW(model.parameters())) as opt:
        for _ in range(WARMUP + REPEATS):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            start = time.perf_counter()
            opt._to_update()
            middle = time.perf_counter()
            opt._to_compute(keep_grads=False)
            to_update.append(middle - start)
            to_compute.append(time.perf_counter() - middle)
    return statistics.median(to_update[WARMUP:]), statistics.median(to_compute[WARMUP:])


def bytes_per_param(setup: str) -> dict[str, float]:
    """Train two steps of ``setup``, run a third backward, and count every live training tensor by role.

    The breakdown is taken after that backward (the peak around the optimizer step); "between steps" is the total
    after the third step and zero_grad(), which is what lives alongside the activations of the next forward.
    """
    half = setup in ("pure fp16", "fp16 + MasterWeights")
    model = make_model(torch.float16 if half else torch.float32, MEMORY_WIDTH)
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-4 if half else 1e-8)
    if setup == "fp16 + MasterWeights":
        opt = MasterWeights(opt)
    scaler = torch.amp.GradScaler("cpu", enabled=setup in ("AMP (fp32 params)", "fp16 + MasterWeights"))
    x = torch.randn(8, MEMORY_WIDTH)
    for step in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=setup == "AMP (fp32 params)"):
            out = model(x.half() if half else x)
        scaler.scale(F.mse_loss(out.float(), x)).backward()
        if step < 2:
            scaler.step(opt)
            scaler.update()
    counts = _count_bytes(model, opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    counts["between steps"] = _count_bytes(model, opt)["total"]
    if isinstance(opt, MasterWeights):
        opt.detach()
    return counts


def _count_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
    master_weights = opt if isinstance(opt, MasterWeights) else None
    roles: dict[str, list[torch.Tensor]] = {
        # Masters first: between backward and step the parameters *are* the masters (same storage).
        "masters": master_weights.masters if master_weights else [],
        # The half copies forward uses; MasterWeights keeps them while the parameters hold the masters.
        "weights": [*model.parameters(), *(master_weights._halves if master_weights else [])],
        "grads": [p.grad for p in model.parameters() if p.grad is not None],
        "optimizer state": [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)],
    }
    numel = sum(p.numel() for p in model.parameters())
    seen: set[int] = set()
    counts = {}
    for role, tensors in roles.items():
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        counts[role] = total / numel
    counts["total"] = sum(counts.values())
    return counts


# Bytes a parameter moves: fused AdamW on fp32 reads the weight, gradient and both moments and writes the weight and
# both moments (7 x 4 bytes); MasterWeights' two phase changes read the half gradient (2) and write the fp32 one
# (4), read the fp32 master (4) and write the half copy (2). A fused kernel cannot take the half gradient (torch
# requires one dtype per tensor list), so these 12 bytes are extra passes.
FUSED_BYTES, PHASE_BYTES = 28, 12


def _print_floor(params: float, fused_step: float, phases: float) -> None:
    """Print the floor the bytes moved put on MasterWeights with fused AdamW, at the fused step's own bandwidth."""
    bandwidth = FUSED_BYTES * params / fused_step
    print(f"Floor from the bytes moved: fused AdamW moves {FUSED_BYTES} B/param "
          f"({bandwidth / 1e9:.1f} GB/s here);\nthe phase changes move {PHASE_BYTES} B/param more, so at that "
          f"bandwidth MasterWeights\nwith fused AdamW costs at least {1 + PHASE_BYTES / FUSED_BYTES:.2f}x plain "
          f"fused AdamW. The phase changes\nran at {PHASE_BYTES * params / phases / 1e9:.1f} GB/s "
          f"({phases * 1e3:.2f} ms).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    torch.set_num_threads(parser.parse_args(argv).threads)
    began = time.perf_counter()
    millions = sum(p.numel() for p in make_model(torch.float32).parameters()) / 1e6
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"MLP {DEPTH} x Linear({WIDTH}, {WIDTH}) = {millions:.2f} M params")
    print(f"\nAdamW step + zero_grad, median of {REPEATS} after {WARMUP} warmup. The last column adds the time to")
    print("allocate the gradients backward hands over (fp32 for the baseline, half under MasterWeights).")
    print(f"{'AdamW variant':<16}{'fp32 params':>14}{'fp16 + MasterWeights':>24}{'ratio':>8}"
          f"{'ratio with grad allocation':>29}")
    for variant, kwargs in (("default", {}), ("foreach=True", {"foreach": True}), ("fused=True", {"fused": True})):
        baseline, wrapped = time_pair(**kwargs)
        step_b, step_w = (statistics.median(s[1] for s in samples) for samples in (baseline, wrapped))
        total_b, total_w = (statistics.median(s[0] + s[1] for s in samples) for samples in (baseline, wrapped))
        print(f"{variant:<16}{step_b * 1e3:>11.2f} ms{step_w * 1e3:>21.2f} ms{step_w / step_b:>7.2f}x"
              f"{total_w / total_b:>28.2f}x")
        if variant == "fused=True":
            fused_step = step_b
    to_update, to_compute = time_phase_changes()
    print(f"MasterWeights' share: half grads -> fp32 grads {to_update * 1e3:.2f} ms (allocation included), "
          f"fp32 masters -> half weights {to_compute * 1e3:.2f} ms")
    _print_floor(millions * 1e6, fused_step, to_update + to_compute)

    print("\nBytes per parameter after backward (the peak around the optimizer step), and between steps")
    columns = ("weights", "masters", "grads", "optimizer state", "total", "between steps")
    print(f"{'setup':<22}" + "".join(f"{c:>16}" for c in columns))
    for setup in ("fp32 AdamW", "AMP (fp32 params)", "pure fp16", "fp16 + MasterWeights"):
        counts = bytes_per_param(setup)
        print(f"{setup:<22}" + "".join(f"{counts[c]:>16.2f}" for c in columns))
    print(f"\n(done in {time.perf_counter() - began:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
