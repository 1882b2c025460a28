# source: https://github.com/qubvel-org/segmentation_models.pytorch/issues/463
# reproduces: a soft Dice loss on fp16 probabilities (the target cast with type_as) under fp16 autocast: the
#   intersection and cardinality sums over 2x1x320x320 pixels exceed 65504 and overflow to inf, inf / inf = NaN, so the
#   Dice loss is NaN at every step (the sums are ~1e5 and finite in fp32) and every step is skipped.
# expect: AMP702
# expect-detail: AMP702 aten\.sum\.default at n05_\w+\.py:17 \(forward, float16\)
# ampdoctor-args: --audit
import sys

import torch
from torch import nn


def soft_dice_loss(logits, target, eps=1e-7):
    prob = logits.sigmoid()
    target = target.type_as(prob)  # fp16 like the prediction
    intersection = torch.sum(prob * target)
    cardinality = torch.sum(prob + target)
    return 1.0 - (2.0 * intersection + eps) / (cardinality + eps)


torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))
with torch.no_grad():
    model[2].bias.fill_(2.0)  # mostly-foreground masks: probabilities ~0.9
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
images = torch.randn(2, 3, 320, 320)
masks = (torch.rand(2, 1, 320, 320) < 0.8).float()
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = soft_dice_loss(model(images), masks)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: dice loss = {loss.item()} at every step (fp16 sums over {masks.numel()} pixels overflow); "
             f"loss scale fell to {scaler.get_scale():g}")
