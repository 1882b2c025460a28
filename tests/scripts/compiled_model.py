"""A torch.compile'd model (the eager backend: no C compiler needed) under fp16 autocast and a GradScaler."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
compiled = torch.compile(model, backend="eager")
for step in range(4):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(compiled(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print(f"loss {loss.item():.4f}")
