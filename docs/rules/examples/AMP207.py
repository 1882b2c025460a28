"""A GradScaler built with ``growth_factor=0.5`` (meant as the backoff factor): torch refuses it with a bare
assertion."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", growth_factor=0.5)  # must be > 1
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
