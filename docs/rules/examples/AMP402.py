"""A grad-norm guard skips ``scaler.step()`` on an outlier batch and ``continue``s without ``scaler.update()``:
the next iteration's ``unscale_()`` raises."""
# reproduces: https://github.com/Haian-Jin/LVSM/pull/19
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    x, y = torch.randn(16, 16), torch.randn(16, 1)
    if step == 3:
        y = y * 1e4  # an outlier batch
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if not torch.isfinite(norm) or norm > 1000:
        print(f"step {step}: grad norm {norm:.3g}, skipping")
        continue  # forgot scaler.update()
    scaler.step(opt)
    scaler.update()
