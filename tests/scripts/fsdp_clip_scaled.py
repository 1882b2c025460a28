"""FSDP's own model.clip_grad_norm_ called on still-scaled gradients (before scaler.unscale_), one gloo rank."""
import socket
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
torch.manual_seed(0)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # "switching to NO_SHARD since the world size is 1"
    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),
                                     device_id=torch.device("cpu"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(3):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    model.clip_grad_norm_(1.0)  # BUG: the gradients are still multiplied by the loss scale
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    print(f"loss {loss.item():.6f}")
dist.destroy_process_group()
