"""Gradient clipping moved after ``scaler.step(opt)`` (to log the norm): ``unscale_()`` after the step raises."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.unscale_(opt)  # to log the true gradient norm: too late
    print("grad norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
    scaler.update()
