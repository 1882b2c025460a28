# source: https://github.com/pytorch/pytorch/issues/88474
# reproduces: nothing - the Conv1d -> ReLU -> BatchNorm1d classifier and fp16 AMP loop of n12 without the corrupted
#   recording: no forward overflows, no step is skipped, and the BatchNorm running statistics stay finite.
# expect: quiet
# ampdoctor-args: --audit
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
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
model.eval()
with torch.no_grad():
    out = model(x)
assert torch.isfinite(out).all()
print(f"final loss {loss.item():.4f} scale {scaler.get_scale():g}, eval acc {(out.argmax(1) == y).float().mean():.2f}")
