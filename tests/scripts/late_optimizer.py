"""The optimizer is built after a few forward passes (a warm-up that sizes the model lazily), under fp16 AMP."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
for _ in range(5):
    model(torch.randn(2, 8)).sum().backward()  # warm-up passes, no optimizer yet
model.zero_grad()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(3):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    print(f"loss {loss.item():.6f}")
