# source: failures.md row 33 (pytorch/torchtitan #1735: "fp16 backward can still underflow" without a scaler;
#   no URL given there) and section 7 (fp16 normal minimum ~6.1e-5)
# reproduces: fp16 autocast with no GradScaler: the per-element gradients of a small mean loss (~3e-9) are below
#   fp16's smallest subnormal, so the fp16 backward flushes them to 0 and the first layer gets an all-zero grad.
# expect: AMP208
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
opt = torch.optim.SGD(model.parameters(), lr=1.0)
x = torch.randn(4096, 16)
with torch.no_grad():
    y = model(x) + 1e-4 * torch.randn(4096, 16)  # already close: residuals ~1e-4
for step in range(5):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    zero = (model[0].weight.grad == 0).float().mean().item()
    print(f"step {step} loss {loss.item():.3e} zero grads in layer 0: {zero:.0%}")
if zero == 1.0:
    sys.exit("SYMPTOM: the first layer's gradient is all zeros (fp16 underflow in the backward)")
