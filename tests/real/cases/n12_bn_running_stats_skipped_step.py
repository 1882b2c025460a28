# source: https://github.com/pytorch/pytorch/issues/88474
# reproduces: Conv1d -> ReLU -> BatchNorm1d with fp16 autocast + GradScaler; a saturated recording (-6e4) in the first
#   batch overflows the fp16 conv output: the GradScaler skips that step, but BatchNorm already folded inf into
#   running_mean/var. Training then looks normal (train mode uses batch stats) and model.eval() outputs NaN.
# expect: AMP707
# expect-detail: AMP707 ^2 \(BatchNorm1d\): the buffers running_mean, running_var .* skipped step
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv1d(3, 16, 3, padding=1), nn.ReLU(), nn.BatchNorm1d(16),
                      nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 3, 64), torch.randint(0, 4, (32,))
for step in range(8):
    xb = x.clone()
    if step == 0:
        xb[5] = -6e4  # one saturated recording (sensor glitch) in the first batch: fits fp16, conv output does not
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(xb).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
model.eval()
with torch.no_grad():
    out = model(x)
if not torch.isfinite(out).all():
    bn = model[2]
    sys.exit(f"SYMPTOM: eval outputs are NaN; BatchNorm running_mean finite: {bool(bn.running_mean.isfinite().all())}, "
             f"running_var finite: {bool(bn.running_var.isfinite().all())} (poisoned on the skipped step 0)")
