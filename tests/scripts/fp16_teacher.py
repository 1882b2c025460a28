"""Distillation with a frozen teacher kept in float16 (the student trains under fp16 autocast and a GradScaler).
The argument picks the teacher's fault: ``overflow`` (its last layer's output overflows fp16: inf logits) or
``weights`` (weights scaled past 65504 after the cast: inf weights). Either way the KL loss is NaN and every step
is skipped, while every output of the student is finite."""
import sys

import torch
from torch import nn

fault = sys.argv[1] if len(sys.argv) > 1 else "overflow"
torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10)).half().eval().requires_grad_(False)
with torch.no_grad():
    if fault == "overflow":
        teacher[0].weight.mul_(10)
        teacher[2].weight.mul_(1e4)   # finite in fp16 (at most 1.25e3); its outputs are not
    else:
        teacher[2].weight.mul_(1e6)   # 0.25 * 1e6 > 65504: inf in fp16
student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(12):
    x = torch.randn(32, 16)
    with torch.no_grad():
        target = teacher(x.half()).float()
    with torch.autocast("cpu", dtype=torch.float16):
        logits = student(x)
        loss = nn.functional.kl_div(logits.float().log_softmax(-1), target.softmax(-1), reduction="batchmean")
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("done", loss.item())
