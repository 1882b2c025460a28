# source: https://github.com/pytorch/pytorch/issues/44511 (failures.md row 23)
# reproduces: the first fp16 steps overflow at the initial scale 65536 and GradScaler skips optimizer.step(),
#   but lr_scheduler.step() runs anyway -> UserWarning: Detected call of `lr_scheduler.step()` before
#   `optimizer.step()`, and the schedule advances on steps that did not update the weights.
# expect: AMP409
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 16)
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).sum()  # a summed loss: d(loss)/d(out) * 65536 > 65504 at first
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    print(f"step {step} scale {scaler.get_scale():g} lr {sched.get_last_lr()[0]:.4f}")
