# source: https://github.com/mk-minchul/AdaFace/issues/127 (failures.md row 9)
# reproduces: one PReLU submodule edited to fp16 inside an fp32 backbone; fp16 AMP with a GradScaler
#   -> ValueError: Attempting to unscale FP16 gradients. (names no parameter)
# expect: AMP101
# expect-detail: AMP101 \b3\.weight
# fix: finishes
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.PReLU(64), nn.Linear(64, 16), nn.PReLU(16), nn.Linear(16, 1))
model[3].half()  # the stray cast: one activation module in half
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 32)
y = x[:, :1] - x[:, 1:2]
for step in range(20):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
print(f"final loss {loss.item():.4f}")
