"""The first fp16 steps overflow at the initial loss scale and GradScaler skips them, but the learning-rate
scheduler steps anyway: the schedule advances on steps that did not update the weights."""
# reproduces: https://github.com/pytorch/pytorch/issues/44511
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
        loss = model(x).float().pow(2).sum()  # a summed loss: its gradients times 65536 overflow fp16 at first
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()  # runs even when scaler.step() skipped opt.step()
