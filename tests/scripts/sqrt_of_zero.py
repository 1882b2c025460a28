"""A loss scale that falls to nothing though no value overflows fp16: the loss is ``sqrt(0)``, whose gradient
(d/dx sqrt(x) at 0) is inf in any dtype, so every step is skipped and the GradScaler halves its scale each time.

Usage: ``python sqrt_of_zero.py [STEPS]`` (60 by default).
"""

import sys

import torch
from torch import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(32, 8)
for step in range(steps):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
        loss = torch.sqrt((out - out.detach()).pow(2).mean())
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
