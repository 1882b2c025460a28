"""A hand-written fp16 loss scaler in the style of improved-diffusion's / guided-diffusion's ``MixedPrecisionTrainer``
(written for the tests, not copied): fp16 model weights, an fp32 flat master copy that the optimizer steps, the
script's own ``lg_loss_scale``, and a skipped step whenever the fp16 gradients are not finite.

``broken``: the scale starts far too high and backs off slowly: most iterations are skipped while the loss grows.
``healthy``: the scale starts a little high; a few calibration skips, then every step trains.
"""

import sys

import torch
from torch import nn

mode = sys.argv[1] if len(sys.argv) > 1 else "broken"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 16)).half()
master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
opt = torch.optim.AdamW(master, lr=1e-3)
lg_loss_scale, backoff, iterations = (30.0, 2.0, 10) if mode == "broken" else (20.0, 1.0, 40)
data = torch.randn(iterations, 8, 16)
for step in range(iterations):
    x = data[step].half()
    growth = (1 + step) ** 1.5 if mode == "broken" else 1.0   # the broken run's loss grows
    loss = (model(x).float() - x.float()).pow(2).mean() * growth
    for p in model.parameters():
        p.grad = None
    (loss * 2 ** lg_loss_scale).backward()
    grads = [p.grad.float() / 2 ** lg_loss_scale for p in model.parameters()]
    if any(not torch.isfinite(g).all() for g in grads):
        lg_loss_scale -= backoff   # overflow: skip this step
        continue
    for m, g in zip(master, grads):
        m.grad = g
    opt.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), master):
            p.copy_(m)
    lg_loss_scale += 1e-3
print(f"final loss {loss.item():.4g}, lg_loss_scale {lg_loss_scale:.3f}")
