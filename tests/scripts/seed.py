"""The seed failure: a whole model in fp16, fp16 autocast, GradScaler -> 'Attempting to unscale FP16 gradients'.

    python seed.py [STEPS] [DEVICE]      # 30 steps on "cpu" by default; bench/gpu/run_all.sh runs it on "cuda"
"""
import sys

import torch
from torch import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
model.half().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler(device)
x = torch.randn(128, 16).to(device)
y = x[:, :1] * 3.0
for step in range(steps):
    with torch.autocast(device, dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    print(f"loss {loss.item():.6f}")
