"""Gradient accumulation over 4 micro-batches that unscales and clips on every micro-batch: the second
``unscale_()`` before ``update()`` raises."""
# reproduces: https://github.com/huggingface/accelerate/issues/641
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
accum = 4
data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(8)]
for i, (x, y) in enumerate(data):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y) / accum
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # should be inside the `if` below, once per update
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if (i + 1) % accum == 0:
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
