# source: https://github.com/pytorch/pytorch/issues/74739
# also: https://github.com/huggingface/transformers/issues/23165 (failures.md row 1)
# reproduces: the whole model cast with .half(), then trained with fp16 autocast + GradScaler
#   -> ValueError: Attempting to unscale FP16 gradients. (AdamW eps=1e-8 is also 0 in fp16)
# expect: AMP101 AMP104
# fix: finishes
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).half()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 32)
y = x[:, :1] * 2.0
for step in range(20):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
print(f"final loss {loss.item():.4f}")
