"""The seed failure: a whole model in fp16, fp16 autocast, GradScaler -> 'Attempting to unscale FP16 gradients'."""
import sys

import torch
from torch import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
model.half()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(128, 16)
y = x[:, :1] * 3.0
for step in range(steps):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    print(f"loss {loss.item():.6f}")
