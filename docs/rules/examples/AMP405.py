"""``loss.backward()`` instead of ``scaler.scale(loss).backward()`` (as when Lightning's manual optimization calls
``loss.backward()`` rather than ``self.manual_backward(loss)``): the scaler has no scale, and ``step()`` raises."""
# reproduces: https://github.com/Lightning-AI/pytorch-lightning/issues/19695
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()  # not scaled
    scaler.step(opt)
    scaler.update()
