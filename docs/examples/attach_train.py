"""The seed error in a script started as ``python attach_train.py``, with ``ampdoctor.attach()`` at its top.

    python docs/examples/attach_train.py          # the report at exit, under the traceback; exit status 1
"""
import torch
from torch import nn

import ampdoctor

ampdoctor.attach()  # before the training objects are built (or: with ampdoctor.attach(json_path=...): train())

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(4):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)                  # ValueError: Attempting to unscale FP16 gradients.
    scaler.update()
    print(f"step {step}  loss {loss.item():.4f}")
