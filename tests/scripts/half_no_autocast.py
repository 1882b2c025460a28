"""Pure fp16 training without autocast or a scaler: small updates round away (needs fp32 master weights)."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(128, 16).half()
y = x[:, :1].float() * 3.0
for step in range(30):
    loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"loss {loss.item():.6f}")
