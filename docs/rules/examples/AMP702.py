"""A frozen fp16 base model whose RMSNorm squares its input in fp16 (no upcast, as T5LayerNorm once did): tokens with
an outlier feature (~400) square to inf, ``rsqrt(inf)`` is 0, and the norm outputs 0 for them. No NaN, no skipped
step: the trainable head never sees those tokens."""
# command: ampdoctor run --audit {script}
# reproduces: https://github.com/huggingface/transformers/pull/10956 (T5LayerNorm: variance in fp32)
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)   # in x.dtype: fp16 overflows above |x| ~ 256
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


torch.manual_seed(0)
base = nn.Sequential(nn.Embedding(64, 32), RMSNorm(32)).half().requires_grad_(False)
with torch.no_grad():
    base[0].weight[:16, 5] = 400.0   # an outlier feature on the first 16 tokens
head = nn.Linear(32, 64)
opt, scaler = torch.optim.AdamW(head.parameters(), lr=1e-2), torch.amp.GradScaler("cpu")
ids = torch.arange(64)
for step in range(4):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(head(base(ids)).float(), ids)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"loss {loss.item():.4f}")
