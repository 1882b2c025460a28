"""L-BFGS, which re-evaluates the loss through a closure, is stepped through an enabled GradScaler:
``scaler.step(opt, closure=...)`` raises."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(64, 8), torch.randn(64, 1)


def closure():
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    return loss


for step in range(3):
    scaler.step(opt, closure=closure)
    scaler.update()
