# source: https://github.com/pytorch/pytorch/issues/32137
# reproduces: nothing - the frozen fp16 encoder, the blank sample and the fp16 AMP loop of n01, with the F.normalize
#   eps taken from the feature dtype (torch.finfo(torch.float16).tiny, representable in fp16).
# expect: quiet
# ampdoctor-args: --audit
import torch
import torch.nn.functional as F
from torch import nn


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU()).half().requires_grad_(False)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        feats = self.encoder(x.half())
        return self.head(F.normalize(feats, dim=-1, eps=torch.finfo(feats.dtype).tiny))


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
    assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f} scale {scaler.get_scale():g}")
