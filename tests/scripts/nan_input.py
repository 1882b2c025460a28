"""A data pipeline that yields a NaN in one batch (a feature normalised by a zero standard deviation).

    python nan_input.py [FIRST_BAD_STEP]   (2 by default)
"""
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    if step >= (int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        x[:, 3] = (x[:, 3] - x[:, 3].mean()) / torch.zeros(())  # std 0: NaN/inf in the batch
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    print(f"step {step} loss {loss.item()}")
