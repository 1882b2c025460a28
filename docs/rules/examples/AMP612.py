"""A hand-written static loss scale (2**24, from an old apex config) skips every step whose gradients overflow, as
a loss scaler should, but never lowers the scale: every step overflows under fp16 autocast, so none is taken."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
loss_scale = 2.0**24  # static: nothing ever lowers it
x, y = torch.randn(64, 16), torch.randn(64, 1)
taken = 0
for step in range(10):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    (loss * loss_scale).backward()
    if not all(torch.isfinite(p.grad).all() for p in model.parameters()):
        continue  # overflow: skip this step (and keep the same scale)
    for p in model.parameters():
        p.grad /= loss_scale
    opt.step()
    taken += 1
print(f"{taken} of 10 steps taken, loss {loss.item():.4f}")
