"""The model is cast to bfloat16 and trained directly, with no autocast and no fp32 master weights: the optimizer
updates bf16 weights, where updates smaller than 1/256 of a weight round away."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(torch.bfloat16)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(32, 1)
for step in range(3):
    loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"final loss {loss.item():.4f}")
