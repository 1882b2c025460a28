# source: https://github.com/pytorch/pytorch/pull/133085
# reproduces: nothing - the frozen fp16 base, the outlier channel and the fp16 AMP loop of n04, with the RMSNorm
#   computing the variance in fp32 and casting back, as LlamaRMSNorm does.
# expect: quiet
# ampdoctor-args: --audit
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(x.dtype)


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
    model.base[0].weight[:16, 5] = 400.0
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
    assert torch.isfinite(loss)
assert not (hidden == 0).all(-1).any()
print(f"final loss {loss.item():.4f} scale {scaler.get_scale():g}")
