"""A 10-step fp16 AMP run whose feed-forward output overflows fp16 at every step (a T5-style `wo` projection)."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(16, 64)
        self.wo = nn.Linear(64, 16)

    def forward(self, x):
        return x + self.wo(torch.relu(self.wi(x)))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), Block(), nn.Linear(16, 1))
with torch.no_grad():
    model[1].wo.weight.mul_(3e5)  # fine in fp32, above 65504 in fp16
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(10):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    print(f"step {step} loss {loss.item()} scale {scaler.get_scale():g}")
