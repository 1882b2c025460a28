"""torch.multiprocessing.spawn of two DDP workers on gloo (the DDP tutorial's layout), each with the seed error: a
model cast with .half() under fp16 autocast and a GradScaler. The port comes from PORT."""
import os

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ["PORT"]
    init_process_group("gloo", rank=rank, world_size=world_size)
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


if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2)
