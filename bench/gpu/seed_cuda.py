"""The seed error on CUDA: a model cast with .half() under fp16 autocast and GradScaler('cuda')."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).cuda().half()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cuda")
x = torch.randn(256, 32, device="cuda")
y = x[:, :1] * 2.0 + 1.0
for step in range(20):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
print(f"done: loss {loss.item():.4f}")
