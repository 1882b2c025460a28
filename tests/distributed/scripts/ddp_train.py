"""A tiny DDP job on gloo (CPU): fp16 autocast, a real GradScaler, and one failure chosen on the command line.

python -m torch.distributed.run --nproc-per-node 2 ddp_train.py MODE [STEPS]

MODE:
    seed        a stray ``.half()`` on the head, on every rank: the first ``scaler.unscale_`` raises
                "Attempting to unscale FP16 gradients." on each rank
    clean       nothing wrong: trains STEPS steps
    crash1      rank 1 alone calls ``scaler.unscale_`` twice at step 2 (in torchrun's first attempt only), while
                rank 0 goes on into the next all-reduce
    kill1       rank 1 SIGKILLs itself at step 6
    overflow    every rank feeds inputs whose forward overflows fp16 in its first Linear, at every step
    overflow1   rank 1 alone feeds inputs whose forward overflows fp16 in its first Linear, at every step: DDP's
                gradient sum carries the inf to rank 0, so both ranks' GradScalers skip every step
"""

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

mode = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
if mode == "seed":
    model[2].half()  # the stray cast: the head's parameters become trainable float16
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
torch.manual_seed(1 + rank)
for step in range(steps):
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    if mode == "overflow" or (mode == "overflow1" and rank == 1):
        x = x * 1e5   # above 65504 after the first Linear in fp16
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (ddp(x).float() - y).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    if mode == "crash1" and rank == 1 and step == 2 and attempt == 0:
        scaler.unscale_(opt)  # raises: unscale_() has already been called on this optimizer since the last update()
    if mode == "kill1" and rank == 1 and step == 6:
        os.kill(os.getpid(), signal.SIGKILL)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print(f"rank {rank} done, loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
