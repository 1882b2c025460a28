"""``max_norm=0.1`` was copied from another recipe, and this model's gradient norm is far above it: every step is
clipped, so the optimizer (and any statistics of the gradients) only ever sees clipped gradients."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 16)
y = 10.0 * x[:, :1]  # targets of size ~10: gradient norms of ~10 and more
for step in range(20):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    scaler.step(opt)
    scaler.update()
print(f"loss {loss.item():.3f}")
