# source: https://github.com/pytorch/pytorch/issues/40907 (failures.md row 24)
# reproduces: clip_grad_norm_(…, 1.0) on gradients still multiplied by the loss scale (65536): the effective
#   clip threshold is ~1.5e-5, so "the loss does not decrease anymore" - no error.
# expect: AMP408
import sys

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
    if step == 0:
        first = loss.item()
    opt.zero_grad()
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # missing scaler.unscale_(opt) before this
    scaler.step(opt)
    scaler.update()
print(f"loss {first:.4f} -> {loss.item():.4f}")
if loss.item() > 0.9 * first:
    sys.exit(f"SYMPTOM: the loss does not decrease ({first:.4f} -> {loss.item():.4f} in 40 steps)")
