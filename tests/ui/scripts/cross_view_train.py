"""Tiny training runs for tests/ui/test_cross_view.py, one per MODE, each with a known mixed-precision problem.

python cross_view_train.py MODE [STEPS]

MODE:
    bf16_lost       a pure-bf16 model and SGD whose small updates round away in the bf16 weights (lost updates)
    fp16_underflow  fp16 autocast and a GradScaler; ``tiny`` runs in fp32 on inputs spread over seven decades and
                    half of them exactly 0, so a share of its gradient entries would flush to 0 in fp16 at the loss
                    scale, and its two parameters have very different shares of zero entries
    skips           fp16 autocast and a GradScaler starting at 2**22: the scaled backward overflows fp16 until the
                    scale has halved enough, so the first steps are skipped
    bf16_scaler     ``fp16_underflow`` under bf16 autocast, with the GradScaler left on: the run computes in bf16, and
                    its loss scale is about fp16's range
    ddp             ``fp16_underflow`` under DistributedDataParallel on gloo (run it with torchrun)
"""

import sys

import torch
from torch import nn

mode = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.tiny = nn.Linear(16, 4)
        # |input| of tiny from 1e-7 to 1, every other one exactly 0: its weight's gradient columns follow it
        self.register_buffer("spread", torch.logspace(-7, 0, 16) * (torch.arange(16) % 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x).float()
        with torch.autocast("cpu", enabled=False):   # kept in fp32: its small gradients are not flushed here
            return self.tiny(h * self.spread)


torch.manual_seed(0)
if mode == "bf16_lost":
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(8, 32, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    sys.exit(0)

if mode == "ddp":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(Net())
else:
    model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22 if mode == "skips" else 2.0**16)
factor = 1.0 if mode == "skips" else 1e-9   # 1e-9: the largest scaled gradient stays far below 1 (no flush floor)
for _ in range(steps):
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16 if mode == "bf16_scaler" else torch.float16):
        loss = model(x).float().pow(2).mean() * factor
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
if mode == "ddp":
    dist.destroy_process_group()
