# source: https://github.com/pytorch/pytorch/issues/32137
# reproduces: a frozen feature encoder kept in fp16 (weight_dtype) feeds F.normalize with its default eps=1e-12, then
#   a trainable fp32 head under fp16 autocast + GradScaler. 1e-12 is 0 in fp16, so the norm clamp does nothing and
#   the blank (all-zero) sample's feature row is 0/0 = NaN: the loss is NaN at every step and every step is skipped.
# expect: AMP701
# expect-detail: AMP701 min=1e-12 is 0 in float16: aten\.clamp_min.* n01_\w+\.py:22; NaN/inf follows in aten\.div
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from torch import nn


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU()).half().requires_grad_(False)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        feats = F.normalize(self.encoder(x.half()), dim=-1)  # eps=1e-12 -> 0.0 in fp16
        return self.head(feats)


torch.manual_seed(0)
model = Probe()
opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
x[3] = 0.0  # a blank / padded sample in the batch
for step in range(8):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: loss = {loss.item()} at every step (F.normalize of the blank row is 0/0 in fp16); "
             f"loss scale fell to {scaler.get_scale():g}")
