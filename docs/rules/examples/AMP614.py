"""The targets are stored in bf16 (to save memory) and the loss is written by hand, so under bf16 autocast it is a
bf16 number: near 3000 bf16's spacing is 16, and a loss that falls by less than that stays bit-identical from step
to step while AdamW moves the weights."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(64, 8)
y = (50.0 + 10.0 * x[:, :1]).bfloat16()  # unnormalised targets (prices, say): a loss of ~3000
for step in range(12):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = (model(x) - y).pow(2).mean()  # bf16 - bf16, squared, averaged: all in bf16
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()}")
