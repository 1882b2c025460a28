"""A bf16 model trained with fp16 autocast and an fp16 GradScaler (a bf16 checkpoint on a pre-Ampere GPU)."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(128, 16)
y = x[:, :1] * 3.0
for step in range(30):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"loss {loss.item():.6f}")
