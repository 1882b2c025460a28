# source: https://github.com/zylo117/Yet-Another-EfficientDet-Pytorch/issues/502
# reproduces: nothing - the head, the confident class-3 bias and the fp16 AMP loop of n02, with the focal loss
#   computed in fp32 (scores upcast before the clamp, where 1 - 1e-4 is representable).
# expect: quiet
# ampdoctor-args: --audit
import torch
from torch import nn


def focal_loss(logits, targets, alpha=0.25, gamma=2.0):
    p = torch.clamp(torch.sigmoid(logits.float()), 1e-4, 1.0 - 1e-4)
    bce = -(targets * torch.log(p) + (1.0 - targets) * torch.log(1.0 - p))
    weight = torch.where(targets == 1.0, alpha * (1.0 - p) ** gamma, (1.0 - alpha) * p**gamma)
    return (weight * bce).sum() / targets.sum().clamp(min=1.0)


torch.manual_seed(0)
head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
with torch.no_grad():
    head[2].bias[3] = 9.0
opt = torch.optim.SGD(head.parameters(), lr=0.01, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
feats = torch.randn(64, 32)
targets = torch.zeros(64, 10)
targets[torch.arange(64), torch.randint(4, 10, (64,))] = 1.0
for step in range(8):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = focal_loss(head(feats), targets)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f} scale {scaler.get_scale():g}")
