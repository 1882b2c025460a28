"""A guard ``clip_grad_norm_(..., error_if_nonfinite=True)`` sits between ``unscale_()`` and ``scaler.step()``: the
first fp16 step overflows at the initial loss scale, which the GradScaler would just skip, and the guard turns that
ordinary skip into a crash."""
# reproduces: https://github.com/pytorch/pytorch/issues/46849
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 16)
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).sum()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.3f}")
