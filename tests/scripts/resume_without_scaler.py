"""Resume from a checkpoint that saved the model and optimizer but not the GradScaler (mmcv-style SGD momentum).

usage: resume_without_scaler.py CKPT [--init-scale S] [--same-process] [--with-scaler]
"""
import sys

import torch
from torch import nn

ckpt = sys.argv[1]
init_scale = float(sys.argv[sys.argv.index("--init-scale") + 1]) if "--init-scale" in sys.argv else 2.0**16


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # keeps no `step` counter
    return model, opt, torch.amp.GradScaler("cpu", init_scale=init_scale)


def train(model, opt, scaler, steps):
    for _ in range(steps):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    print(f"loss {loss.item():.6f} scale {scaler.get_scale():g}")


model, opt, scaler = build()
if "--same-process" in sys.argv:  # train, save, then resume in the same process with new objects
    train(model, opt, scaler, 3)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, ckpt)
    model, opt, scaler = build()
state = torch.load(ckpt)
model.load_state_dict(state["model"])
opt.load_state_dict(state["opt"])
if "--with-scaler" in sys.argv:
    scaler.load_state_dict(state["scaler"])
train(model, opt, scaler, 3)
