"""One stray fp16 parameter in an fp32 model (an ArcFace-style head created in half)."""
import torch
from torch import nn


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.margin = nn.Parameter(torch.ones(16, dtype=torch.float16))

    def forward(self, x):
        return (self.body(x) * self.margin).sum(dim=1, keepdim=True)


torch.manual_seed(0)
model = Head()
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(30):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"loss {loss.item():.6f}")
