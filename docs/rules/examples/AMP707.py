"""One batch overflows fp16 under autocast: the GradScaler skips the step, as it should, but the BatchNorm's forward
already wrote inf into its running statistics; from then on every evaluation is NaN."""
# reproduces: https://github.com/pytorch/pytorch/issues/40497 (BatchNorm running stats NaN after a skipped step)
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    x = torch.randn(32, 8) * (1e5 if step == 2 else 1)   # one outlier batch
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
model.eval()
print(f"eval output {model(torch.randn(2, 8))[0].tolist()}")
