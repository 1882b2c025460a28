"""``opt.step()`` called directly after ``scaler.scale(loss).backward()``: the gradients still carry the loss
scale (65536), so each SGD update is 65536 times too large, and inf/NaN steps are not skipped. Nothing raises."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    opt.step()  # should be scaler.step(opt), then scaler.update()
    print(f"step {step} loss {loss.item():.4g}")
