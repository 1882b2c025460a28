# source: https://github.com/pytorch/pytorch/issues/44511 (failures.md row 23: the early skipped steps are benign)
# reproduces: nothing wrong - a summed fp16 AMP loss overflows at the initial scale 65536, the GradScaler skips
#   the first couple of steps while the scale calibrates, then every step is taken.
# expect: quiet
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 16)
y = x[:, :1] * 2.0
skipped = 0
for step in range(40):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() - y).pow(2).sum() / 16  # a summed (per-token style) loss
    opt.zero_grad()
    before = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped += scaler.get_scale() < before
assert torch.isfinite(loss)
print(f"{skipped} early steps skipped, final scale {scaler.get_scale():g}, loss {loss.item():.3f}")
