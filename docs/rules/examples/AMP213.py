"""``Fabric(precision="16-mixed")`` on a machine without a GPU: Lightning sets up bf16-mixed instead, so the run has
no GradScaler and tests nothing of the fp16 run to come."""
import lightning as L
import torch
from torch import nn

torch.manual_seed(0)
fabric = L.Fabric(accelerator="cpu", devices=1, precision="16-mixed")
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = fabric.setup(model, opt)
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    fabric.backward(loss)
    opt.step()
print(f"precision={fabric.strategy.precision.precision!r}")
