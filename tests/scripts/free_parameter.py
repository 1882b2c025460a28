"""CLIP-style: a logit scale kept outside the model, trained by the model's optimizer under fp16 autocast and a
GradScaler.

    python free_parameter.py [late|half]

``late`` uses the scale only from step 3 on (a warm-up), so it has no gradient at the first optimizer step. ``half``
casts the model with .half(): the first unscale_() raises before any optimizer step, AMP101.
"""
import sys

import torch
from torch import nn

mode = sys.argv[1] if len(sys.argv) > 1 else "late"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
if mode == "half":
    model.half()
logit_scale = nn.Parameter(torch.ones(()))
opt = torch.optim.AdamW([{"params": model.parameters()}, {"params": [logit_scale], "weight_decay": 0.0}], lr=1e-3,
                        eps=1e-4)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(16, 8)
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
        if step >= 3:
            out = out * logit_scale
        loss = (out.float() - x).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
