# source: failures.md section 0 ("Loss becomes nan / inf, the scale keeps halving") and section 12
#   (torch.autograd.detect_anomaly / DebugUnderflowOverflow as the maintainers' answer); no single URL there
# reproduces: one sample of the dataset holds a NaN feature; under fp16 AMP the loss is NaN on every step and
#   the GradScaler keeps halving the scale, which looks like an fp16 overflow but is the data.
# expect: AMP609
# expect-detail: AMP609 (?i)\binput
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(64, 8), torch.randn(64, 1)
x[17, 3] = float("nan")  # a corrupt sample
for step in range(10):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: loss = {loss.item()} on every step, loss scale down to {scaler.get_scale():g}")
