"""FSDP (FSDP1) shards every gradient across two ranks, and the loop uses a plain GradScaler: each rank checks only
its own shard for inf/NaN, so one rank can skip a step that the other applies."""
# command: torchrun --nproc-per-node 2 -m ampdoctor run {script}
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

warnings.simplefilter("ignore")  # FSDP1's deprecation notice
dist.init_process_group("gloo")
torch.manual_seed(0)
model = FSDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)), device_id=torch.device("cpu"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")  # not a ShardedGradScaler
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
dist.destroy_process_group()
