"""A checkpoint holds the model and the optimizer but not the GradScaler: after the resume the loss scale
restarts at 65536 (it had settled lower), and the first steps overflow and are skipped again."""
# reproduces: https://github.com/huggingface/transformers/issues/34053
import io

import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), torch.amp.GradScaler("cpu")


def train(model, opt, scaler, steps):
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).sum()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


torch.manual_seed(0)
x = torch.randn(64, 16)
model, opt, scaler = build()
train(model, opt, scaler, 10)
ckpt = io.BytesIO()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)  # no scaler.state_dict()

model, opt, scaler = build()  # restart after preemption
ckpt.seek(0)
state = torch.load(ckpt)
model.load_state_dict(state["model"])
opt.load_state_dict(state["opt"])
train(model, opt, scaler, 8)
