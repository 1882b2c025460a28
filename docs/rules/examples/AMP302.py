"""A backbone is frozen and only the head is meant to train, but the optimizer is given the backbone's parameters:
the head gets gradients and is never updated."""
import torch
from torch import nn

torch.manual_seed(0)
backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU()).requires_grad_(False)
head = nn.Linear(32, 2)
model = nn.Sequential(backbone, head)
opt = torch.optim.AdamW(backbone.parameters(), lr=1e-3)  # meant: head.parameters()
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randint(0, 2, (32,))
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"final loss {loss.item():.4f}")
