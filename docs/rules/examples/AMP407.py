"""The optimizer step sits under an ``if`` that is false on this iteration while ``scaler.update()`` still
runs: ``update()`` has no inf check to read, and raises."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
accum = 2
x, y = torch.randn(32, 16), torch.randn(32, 1)
for i in range(4):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y) / accum
    scaler.scale(loss).backward()
    if (i + 1) % accum == 0:
        scaler.step(opt)
        opt.zero_grad()
    scaler.update()  # should be inside the `if`, after step()
