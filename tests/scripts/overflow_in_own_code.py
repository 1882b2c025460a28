"""An fp16 AMP run whose overflow happens in a module's own code (torch.exp in Scores.forward), not in a child."""
import torch
from torch import nn


class Scores(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        e = torch.exp(self.inp(x) * 30)  # above 65504 in fp16, in this module's own code
        return self.proj(e)              # the first *module output* that is not finite is proj's


torch.manual_seed(0)
model = nn.Sequential(Scores(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
