"""FSDP computes in fp16 over two ranks and leaves ``reduce_dtype`` unset, so the gradients are summed across
ranks in fp16 too (``reduce_dtype`` defaults to ``param_dtype``)."""
# command: torchrun --nproc-per-node 2 -m ampdoctor run {script}
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

warnings.simplefilter("ignore")  # FSDP1's deprecation notice
dist.init_process_group("gloo")
torch.manual_seed(0)
fp16 = MixedPrecision(param_dtype=torch.float16)  # no reduce_dtype=torch.float32
model = FSDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)), mixed_precision=fp16,
             device_id=torch.device("cpu"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = ShardedGradScaler(device="cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
dist.destroy_process_group()
