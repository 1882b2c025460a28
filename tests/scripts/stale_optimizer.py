"""An optimizer over the tensors of a model the script replaced (written for the tests), under bf16 autocast.

usage: stale_optimizer.py MODE
    right   the model, then its optimizer: healthy
    cell    the model is re-created after its optimizer was built (a re-run notebook cell, "load the pretrained
            weights into a fresh object")
    kfold   a new model per fold, each fold's optimizer built one line too early: over the previous fold's model
"""
import sys

import torch
from torch import nn

mode = sys.argv[1]


def make() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


torch.manual_seed(0)
x, y = torch.randn(32, 16), torch.randn(32, 1)
model = make()
if mode == "kfold":
    for fold in range(3):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        model = make()   # the fold's fresh model, one line too late
        train(model, opt, 12)
else:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    if mode == "cell":
        model = make()
    train(model, opt, 12)
print("trained")
