"""Moving to bf16 autocast and an 8x larger batch, the learning rate was scaled up 8x too (the linear scaling rule)
with no warm-up: each SGD step now overshoots, and the loss grows instead of falling, with no inf or NaN."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=8 * 0.017)  # 0.017 converged at the old batch size
x = torch.randn(256, 8) * 3
y = x.sum(1, keepdim=True)
for step in range(12):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4g}")
