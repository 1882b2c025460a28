"""The seed error in a plain script: a ``.half()`` model, fp16 autocast, a GradScaler. Nothing of ampdoctor in it.

    python docs/examples/plain_train.py                   # ValueError: Attempting to unscale FP16 gradients.
    AMPDOCTOR=1 python docs/examples/plain_train.py       # the same, with ampdoctor's report at exit
    AMPDOCTOR=--fix python docs/examples/plain_train.py   # repaired as `ampdoctor run --fix` would; trains 4 steps
"""
import torch
from torch import nn

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
    scaler.step(opt)
    scaler.update()
    print(f"step {step}  loss {loss.item():.4f}")
