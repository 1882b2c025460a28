# source: https://github.com/zylo117/Yet-Another-EfficientDet-Pytorch/issues/502
# reproduces: an EfficientDet-style focal loss that clamps the fp16 sigmoid scores to [1e-4, 1 - 1e-4] under fp16
#   autocast: 1 - 1e-4 rounds to 1.0 in fp16, so a confident negative (logit ~9) gets log(1 - 1.0) = log(0) = -inf,
#   the loss is inf/NaN, the GradScaler skips every step and the weights never move.
# expect: AMP701
# expect-detail: AMP701 max=0\.9999 is 1 in float16: aten\.clamp\.default .* at n02_\w+\.py:15; NaN/inf follows
# ampdoctor-args: --audit
import sys

import torch
from torch import nn


def focal_loss(logits, targets, alpha=0.25, gamma=2.0):
    p = torch.clamp(torch.sigmoid(logits), 1e-4, 1.0 - 1e-4)  # fp16 under autocast: max bound becomes 1.0
    bce = -(targets * torch.log(p) + (1.0 - targets) * torch.log(1.0 - p))
    weight = torch.where(targets == 1.0, alpha * (1.0 - p) ** gamma, (1.0 - alpha) * p**gamma)
    return (weight * bce).sum() / targets.sum().clamp(min=1.0)


torch.manual_seed(0)
head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))  # class head over 10 classes
with torch.no_grad():
    head[2].bias[3] = 9.0  # fine-tuned from a detector that is very sure about class 3
opt = torch.optim.SGD(head.parameters(), lr=0.01, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
feats = torch.randn(64, 32)
targets = torch.zeros(64, 10)
targets[torch.arange(64), torch.randint(4, 10, (64,))] = 1.0  # class 3 is a negative everywhere
for step in range(8):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = focal_loss(head(feats), targets)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: focal loss = {loss.item()} at every step (clamp max 1 - 1e-4 == 1.0 in fp16); "
             f"every step skipped, loss scale fell to {scaler.get_scale():g}")
