"""A half model wrapped in real DDP (one gloo rank), trained without autocast: what `ampdoctor run --fix` must not
break. ``AUTOCAST=1`` runs the forward under fp16 autocast with a GradScaler instead (the upcast case)."""

import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).half())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
autocast = os.environ.get("AUTOCAST") == "1"
scaler = torch.amp.GradScaler("cpu", enabled=autocast)
for step in range(3):
    x = torch.randn(4, 8, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    if autocast:
        scaler.unscale_(opt)   # the user's own bug: fp16 parameters under a GradScaler
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f} weight {model.module[0].weight.dtype}")
dist.destroy_process_group()
