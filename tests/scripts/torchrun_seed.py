"""A DDP job for torchrun (``torchrun --nproc-per-node 2 torchrun_seed.py``) on gloo, each rank with the seed error:
a model cast with .half() under fp16 autocast and a GradScaler. Nothing in it names ampdoctor."""
import torch
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(4, 8), torch.randn(4, 1)
with torch.autocast("cpu", dtype=torch.float16):
    loss = nn.functional.mse_loss(model(x).float(), y)
scaler.scale(loss).backward()
try:
    scaler.step(opt)  # ValueError: Attempting to unscale FP16 gradients.
finally:
    destroy_process_group()
