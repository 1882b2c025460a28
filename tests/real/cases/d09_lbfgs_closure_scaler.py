# source: failures.md section 1.5 and section 0 ("RuntimeError: Closure use is not currently supported if
#   GradScaler is enabled."; no URL given there)
# reproduces: LBFGS with a closure, stepped through an enabled GradScaler
#   -> RuntimeError: Closure use is not currently supported if GradScaler is enabled.
# expect: AMP204
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 8)
y = x.sum(dim=1, keepdim=True)


def closure():
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    return loss


for step in range(3):
    scaler.step(opt, closure=closure)
    scaler.update()
