"""A resume in one process (written for the tests): stage 1 trains and checkpoints; stage 2 builds a new model,
optimizer and GradScaler from the checkpoint, and every step of it overflows."""

import io

import torch
from torch import nn


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def train(model, opt, scaler, steps, poison=False):
    for _ in range(steps):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x).float()
        loss = nn.functional.mse_loss(out * (float("inf") if poison else 1.0), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


model = build()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
train(model, opt, scaler, 5)
buf = io.BytesIO()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
buf.seek(0)
del model, opt, scaler
state = torch.load(buf)
model = build()
model.load_state_dict(state["model"])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
opt.load_state_dict(state["opt"])
scaler = torch.amp.GradScaler("cpu")
train(model, opt, scaler, 12, poison=True)   # every step of the resumed stage overflows
