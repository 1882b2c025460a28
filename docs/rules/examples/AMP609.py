"""One sample of the dataset holds a NaN feature: under fp16 autocast the loss is NaN on every step and the
GradScaler keeps lowering the scale, which looks like an fp16 overflow but is the data."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(64, 8), torch.randn(64, 1)
x[17, 3] = float("nan")  # a corrupt sample (a missing reading stored as NaN)
for step in range(10):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
