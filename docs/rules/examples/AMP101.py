"""The whole model is cast with ``.half()`` and then trained with fp16 autocast and a GradScaler: the scaler
refuses the fp16 gradients at the first ``scaler.step()``."""
# reproduces: https://github.com/pytorch/pytorch/issues/74739
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()  # fp16 weights: the mistake
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
