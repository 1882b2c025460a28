# source: https://github.com/pytorch/pytorch/issues/115500
# reproduces: Linear -> BatchNorm1d under fp16 autocast, the BatchNorm forced to fp32 as tried in the report, plus an
#   EMA copy (AveragedModel, use_buffers=True): one batch of raw features (~1.3e5) overflows the fp16 Linear, the step
#   is skipped, but the running stats and the EMA buffers are already NaN and the EMA model evaluates to NaN.
# expect: AMP707
# expect-detail: AMP707 ^bn \(BatchNorm1d\): the buffers running_mean, running_var hold inf/NaN .* skipped
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1)

    def forward(self, x):
        h = self.fc(x)
        with torch.autocast("cpu", enabled=False):
            h = self.bn(h.float())  # "force fp32 in the bn layer"
        return self.out(torch.relu(h))


torch.manual_seed(0)
model = Net()
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
x = torch.rand(64, 10)
y = x.mean(1, keepdim=True)
for step in range(8):
    xb = x * 65535 * 2 if step == 0 else x  # a batch that skipped the feature scaling
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(xb).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    ema.update_parameters(model)
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
ema.eval()
with torch.no_grad():
    out = ema(x)
if not torch.isfinite(out).all():
    sys.exit(f"SYMPTOM: the EMA model outputs NaN; bn.running_mean = {model.bn.running_mean[:3].tolist()}, EMA "
             f"copy finite: {bool(torch.isfinite(ema.module.bn.running_var).all())} (poisoned on the skipped step 0)")
