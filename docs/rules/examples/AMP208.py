"""fp16 autocast without a GradScaler: the backward runs in fp16 too, and the per-element gradients of a small
mean loss fall below fp16's smallest subnormal (2**-24 ≈ 6e-8) and flush to 0."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
opt = torch.optim.SGD(model.parameters(), lr=1.0)
x = torch.randn(4096, 16)
with torch.no_grad():
    y = model(x) + 1e-4 * torch.randn(4096, 16)  # nearly fitted: residuals ~1e-4
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):  # no GradScaler
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    zero = (model[0].weight.grad == 0).float().mean().item()
    print(f"step {step} loss {loss.item():.2e}, zero gradients in layer 0: {zero:.0%}")
