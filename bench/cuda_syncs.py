"""Count CUDA host syncs per training step with and without ``ampdoctor.watch`` (every step sampled).

    python bench/cuda_syncs.py

``torch.cuda.set_sync_debug_mode("warn")`` warns on every synchronizing call; the script counts the warnings of
each step of a small fp16 AMP loop, without the watch and with ``watch(every=1, stats="full")``, and prints the
difference per step. GradScaler's own ``step`` syncs (``found_inf.item()``) are in both. Needs a CUDA device.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import ampdoctor


def steps(watched: bool, n: int = 6) -> tuple[list[int], object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    w = ampdoctor.watch(model, opt, scaler, every=1, stats="full") if watched else None
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")
    counts = []
    for _ in range(n):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts.append(sum("called a synchronizing CUDA operation" in str(s.message) for s in seen))
    if w is not None:
        w.detach()
    return counts, w


def main() -> None:
    base, _ = steps(False)
    watched, w = steps(True)
    print("syncs per step without watch:", base)
    print("syncs per step with watch    :", watched)
    print("extra per step               :", [a - b for a, b in zip(watched, base)])
    print("watch.host_syncs", w.host_syncs, "sampled", w.sampled_steps, "norm history", w.norm_history[:3])


if __name__ == "__main__":
    main()
