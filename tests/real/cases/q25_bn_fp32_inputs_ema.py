# source: https://github.com/pytorch/pytorch/issues/115500
# reproduces: nothing - the Linear -> BatchNorm1d model, the EMA copy, the raw-feature batch and the fp16 AMP loop
#   of n13, with the input layer and the BatchNorm kept in fp32 on fp32 inputs (autocast disabled for both), so
#   ~1.3e5 features never meet fp16 and the running stats and the EMA buffers stay finite.
# expect: quiet
# ampdoctor-args: --audit
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 1)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            h = self.bn(self.fc(x.float()))
        return self.out(torch.relu(h))


torch.manual_seed(0)
model = Net()
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
x = torch.rand(64, 10)
y = x.mean(1, keepdim=True)
for step in range(8):
    xb = x * 65535 * 2 if step == 0 else x
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(xb).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    ema.update_parameters(model)
    assert torch.isfinite(loss)
ema.eval()
with torch.no_grad():
    out = ema(x)
assert torch.isfinite(out).all()
print(f"final loss {loss.item():.4f} scale {scaler.get_scale():g}")
