# source: https://github.com/huggingface/transformers/issues/34053
# also: https://github.com/huggingface/accelerate/issues/4289 (failures.md row 36, section 10)
# reproduces: a checkpoint with the model and optimizer but not the GradScaler; an in-process restart rebuilds
#   everything and loads the checkpoint, so the scale restarts at 65536 (it had settled at 2048) and the first
#   steps after the resume overflow and are skipped again.
# expect: AMP410
import sys

import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), torch.amp.GradScaler("cpu")


def train(model, opt, scaler, steps):
    skipped = 0
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).sum()
        opt.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale
    return skipped


torch.manual_seed(0)
x = torch.randn(64, 16)
model, opt, scaler = build()
train(model, opt, scaler, 10)
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "ckpt.pt")  # no scaler.state_dict()
settled = scaler.get_scale()

model, opt, scaler = build()  # restart after preemption
ckpt = torch.load("ckpt.pt")
model.load_state_dict(ckpt["model"])
opt.load_state_dict(ckpt["opt"])
skipped = train(model, opt, scaler, 8)
print(f"scale before the restart {settled:g}; {skipped} steps skipped after it")
if skipped:
    sys.exit(f"SYMPTOM: the resumed run restarted the loss scale at 65536 (was {settled:g}) and skipped "
             f"{skipped} steps")
