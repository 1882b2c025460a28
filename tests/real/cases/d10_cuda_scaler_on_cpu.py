# source: https://github.com/pytorch/pytorch/issues/35926 (failures.md row 37, section 11)
# reproduces: torch.amp.GradScaler("cuda") on a machine without CUDA, with fp16 autocast on the CPU: the scaler
#   warns "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling." and then does nothing,
#   so a small loss's fp16 gradients flush to zero and the first layer never learns.
# expect: AMP202
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
opt = torch.optim.SGD(model.parameters(), lr=1.0)
scaler = torch.amp.GradScaler("cuda")  # copied from a GPU script
x = torch.randn(4096, 16)
with torch.no_grad():
    y = model(x) + 1e-4 * torch.randn(4096, 16)
for step in range(5):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"scaler enabled: {scaler.is_enabled()}, loss {loss.item():.3e}")
if bool((model[0].weight.grad == 0).all()):
    sys.exit("SYMPTOM: the scaler disabled itself and the first layer's fp16 gradient underflowed to all zeros")
