"""FSDP (full sharding) with a plain ``torch.amp.GradScaler`` instead of ``ShardedGradScaler``: a corrupt sample on
rank 0 puts NaN into gradients that rank 0's shard holds, so rank 0 skips the step and rank 1 applies it."""
# command: torchrun --nproc-per-node 2 -m ampdoctor run {script}
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

warnings.simplefilter("ignore")  # FSDP's CPU and deprecation notices
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = FSDP(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 8)), device_id=torch.device("cpu"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")  # each rank checks only its own shard for inf/NaN
for step in range(3):
    x = torch.randn(16, 2, generator=torch.Generator().manual_seed(10 * step + rank))
    if step == 1 and rank == 0:
        x[0, 0] = float("inf")  # a corrupt sample: tanh saturates, the loss stays finite
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    scales = [None, None]
    dist.all_gather_object(scales, scaler.get_scale())
    if rank == 0:
        print(f"step {step}: loss scale per rank {scales}")
dist.destroy_process_group()
