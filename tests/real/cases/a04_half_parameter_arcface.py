# source: https://github.com/Lightning-AI/pytorch-lightning/issues/7078 (failures.md row 9)
# reproduces: an ArcFace-style head whose weight is created as nn.Parameter(torch.HalfTensor(...)) in an
#   otherwise fp32 model; fp16 AMP -> ValueError: Attempting to unscale FP16 gradients.
# expect: AMP101
# expect-detail: AMP101 \b1\.weight
# fix: finishes
import torch
from torch import nn


class ArcHead(nn.Module):
    def __init__(self, dim, classes):
        super().__init__()
        self.weight = nn.Parameter(torch.HalfTensor(classes, dim))
        nn.init.normal_(self.weight, std=0.1)

    def forward(self, emb):
        return nn.functional.linear(nn.functional.normalize(emb), nn.functional.normalize(self.weight)) * 16.0


torch.manual_seed(0)
backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
model = nn.Sequential(backbone, ArcHead(16, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
for step in range(20):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
print(f"final loss {loss.item():.4f}")
