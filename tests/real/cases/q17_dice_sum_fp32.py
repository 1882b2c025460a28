# source: https://github.com/qubvel-org/segmentation_models.pytorch/issues/463
# reproduces: nothing - the segmentation model, the 2x1x320x320 batch and the fp16 AMP loop of n05, with the Dice
#   loss computed on fp32 probabilities (logits upcast first), so the pixel sums stay finite.
# expect: quiet
# ampdoctor-args: --audit
import torch
from torch import nn


def soft_dice_loss(logits, target, eps=1e-7):
    prob = logits.float().sigmoid()
    target = target.type_as(prob)
    intersection = torch.sum(prob * target)
    cardinality = torch.sum(prob + target)
    return 1.0 - (2.0 * intersection + eps) / (cardinality + eps)


torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))
with torch.no_grad():
    model[2].bias.fill_(2.0)
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
    assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f} scale {scaler.get_scale():g}")
