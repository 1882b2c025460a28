"""Fine-tuning the head of a frozen backbone, but the optimizer was given the backbone's (frozen) parameters:
none of them gets a gradient, and ``scaler.step()`` raises."""
# reproduces: https://github.com/huggingface/accelerate/issues/328
from collections import OrderedDict

import torch
from torch import nn

torch.manual_seed(0)
backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
head = nn.Linear(32, 2)
model = nn.Sequential(OrderedDict(backbone=backbone, head=head))
backbone.requires_grad_(False)
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
