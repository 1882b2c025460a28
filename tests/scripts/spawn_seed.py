"""torch.multiprocessing.spawn with two workers, each training a model that was cast with .half()."""
import torch
import torch.multiprocessing as mp
from torch import nn


def worker(rank: int) -> None:
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)  # ValueError: Attempting to unscale FP16 gradients.
    scaler.update()


if __name__ == "__main__":
    mp.spawn(worker, nprocs=2)
