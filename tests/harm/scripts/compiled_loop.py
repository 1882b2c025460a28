"""An fp16-autocast + GradScaler("cpu") loop through ``torch.compile(model)`` with the inductor backend, which fuses
the elementwise ops between the matmuls into C++ kernels (it needs a C++ compiler).

    python compiled_loop.py OUT [STEPS]

saves ``{"state": model.state_dict(), "losses": [loss.item(), ...]}`` to OUT with torch.save. A forward hook
traced into the compiled graph changes the fusions, and so the numbers: ampdoctor's hooks must not be traced.
"""
import sys

import torch
from torch import nn


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6
    torch._dynamo.reset()  # every run compiles afresh, whatever ran in this process before
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    compiled = torch.compile(model)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=gen) * 3, torch.randint(0, 8, (32,), generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(compiled(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    torch.save({"state": model.state_dict(), "losses": losses}, out)


if __name__ == "__main__":
    main()
