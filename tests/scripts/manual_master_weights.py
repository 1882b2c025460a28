"""Hand-written fp32 master weights, the way fairseq's FP16Optimizer, Megatron's Float16Optimizer and apex's
FP16_Optimizer work (without their classes): an fp16 model, fp32 copies that the optimizer steps, a dynamic loss
scale of the script's own, the fp16 grads copied into the copies' .grad and the stepped copies copied back.

    python manual_master_weights.py [per-param|flat|no-copy-back] [STEPS]

``flat`` keeps one flat fp32 tensor for all parameters (fairseq's flat buffer). ``no-copy-back`` never hands the
copies any gradient: the optimizer steps stale tensors and the model never trains (AMP301 and AMP302 are true).
"""
import sys

import torch
from torch import nn

mode = sys.argv[1] if len(sys.argv) > 1 else "per-param"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).half()
params = list(model.parameters())
if mode == "flat":
    flat = torch.cat([p.detach().float().reshape(-1) for p in params]).requires_grad_(True)
    main = [flat]
else:
    main = [p.detach().clone().float().requires_grad_(True) for p in params]
opt = torch.optim.AdamW(main, lr=1e-3)
scale = 2.0 ** 12
gen = torch.Generator().manual_seed(0)
for step in range(steps):
    x, y = torch.randn(8, 16, generator=gen).half(), torch.randint(0, 4, (8,), generator=gen)
    loss = nn.functional.cross_entropy(model(x).float(), y)
    (loss * scale).backward()
    grads = [p.grad.float() / scale for p in params]
    for p in params:
        p.grad = None
    if any(not torch.isfinite(g).all() for g in grads):
        scale /= 2
        continue
    if mode == "flat":
        flat.grad = torch.cat([g.reshape(-1) for g in grads])
    elif mode == "per-param":
        for m, g in zip(main, grads):
            m.grad = g
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        copies = main if mode != "flat" else flat.split([p.numel() for p in params])
        for p, m in zip(params, copies):
            p.copy_(m.view_as(p))
    print(f"step {step} loss {loss.item():.4f}")
