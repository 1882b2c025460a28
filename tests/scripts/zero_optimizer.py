"""DDP + ZeroRedundancyOptimizer + fp16 autocast + GradScaler (the PyTorch recipe "Shard Optimizer States with
ZeroRedundancyOptimizer"), on one gloo rank. ZeRO steps its own per-rank AdamW (``.optim``) inside its step."""
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]))
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(8, 32)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print(f"loss {loss.item():.4f}")
dist.destroy_process_group()
