"""Clipping still-scaled gradients, with clip_grad_norm_ bound at import time (the usual `from ... import`)."""
import sys

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
use_split_api = sys.argv[1:] == ["split"]
for step in range(3):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if use_split_api:
        params = list(model.parameters())
        total = get_total_norm([p.grad for p in params])
        clip_grads_with_norm_(params, 1.0, total)  # BUG: before scaler.unscale_(opt)
    else:
        clip_grad_norm_(model.parameters(), 1.0)  # BUG: before scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    print(f"loss {loss.item():.6f}")
