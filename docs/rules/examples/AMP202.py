"""A training loop copied from a GPU script keeps ``GradScaler("cuda")`` on a machine without CUDA: the scaler
disables itself with one warning, and the fp16 backward runs with no loss scaling."""
# reproduces: https://github.com/pytorch/pytorch/issues/35926
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda")  # but training runs on the CPU
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"scaler enabled: {scaler.is_enabled()}")
