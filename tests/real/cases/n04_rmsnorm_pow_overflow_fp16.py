# source: https://github.com/pytorch/pytorch/pull/133085
# reproduces: a frozen fp16 base whose RMSNorm squares x in the input dtype (T5LayerNorm style, no fp32 upcast), a
#   trainable fp32 head, fp16 autocast + GradScaler: tokens with an outlier feature (~400) square to inf, rsqrt(inf) = 0
#   and the norm outputs exactly 0 for them - no NaN, no skipped step, the head never sees those tokens.
# expect: AMP702
# expect-detail: AMP702 ^base\.1 \(RMSNorm\): aten\.pow\.Tensor_Scalar at n04_\w+\.py:21 \(forward, float16\)
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)  # in x.dtype: fp16 overflows above |x| ~ 256
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Sequential(nn.Embedding(64, 32), RMSNorm(32)).half().requires_grad_(False)  # frozen fp16
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        hidden = self.base(ids)
        return self.head(hidden), hidden


torch.manual_seed(0)
model = Model()
with torch.no_grad():
    model.base[0].weight[:16, 5] = 400.0  # massive-activation channel on the first 16 tokens
opt, scaler = torch.optim.AdamW(model.head.parameters(), lr=1e-2), torch.amp.GradScaler("cpu")
ids = torch.arange(64).repeat(2)
for step in range(8):
    with torch.autocast("cpu", dtype=torch.float16):
        logits, hidden = model(ids)
        loss = F.cross_entropy(logits.float(), ids)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
zero_rows = int((hidden == 0).all(-1).sum())
if zero_rows:
    sys.exit(f"SYMPTOM: the frozen fp16 RMSNorm outputs all-zero hidden states for {zero_rows}/{len(ids)} tokens "
             f"(x.pow(2) = inf in fp16, rsqrt(inf) = 0); loss {loss.item():.4f} is finite")
