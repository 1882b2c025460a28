"""A bf16 checkpoint (here a model cast with ``.to(torch.bfloat16)``) is trained with fp16 autocast and an fp16
GradScaler: two half formats mixed, and the optimizer still updates bf16 weights."""
# reproduces: https://github.com/pytorch/pytorch/issues/127176
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(torch.bfloat16)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)  # CPU's unscale kernel accepts bf16; CUDA's may raise
    scaler.update()
print(f"final loss {loss.item():.4f}")
