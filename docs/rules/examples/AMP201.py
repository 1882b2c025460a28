"""A GradScaler kept from an fp16 script after switching autocast to bfloat16: bf16 has fp32's exponent range, so
the loss scaling does nothing useful and only costs time."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")  # left over from fp16
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"final loss {loss.item():.4f}")
