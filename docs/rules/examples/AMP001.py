"""A correct fp16 AMP loop, during which one of ampdoctor's own checks raises (simulated here by replacing the
AMP101 check with a broken one): ampdoctor reports it once and steps aside; the training is not affected."""
import torch
from torch import nn

import ampdoctor.preflight.engine  # noqa: F401  (registers the checks)
from ampdoctor.preflight.rules import CHECKS


def broken_check(setup):  # stands in for a bug in ampdoctor
    raise KeyError("weight")


CHECKS["AMP101"] = broken_check
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"final loss {loss.item():.4f}")
