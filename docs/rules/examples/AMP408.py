"""``clip_grad_norm_(..., 1.0)`` on gradients still multiplied by the loss scale: the norm is compared to 1.0
times the scale, clipping is always on, and the loss barely moves. Nothing raises."""
# reproduces: https://github.com/pytorch/pytorch/issues/40907
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
x = torch.randn(256, 16)
y = x[:, :1] * 2.0 + x[:, 1:2]
for step in range(40):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # missing scaler.unscale_(opt) before this
    scaler.step(opt)
    scaler.update()
    if step % 10 == 0:
        print(f"step {step} loss {loss.item():.4f}")
