# source: failures.md section 8 (fix: run the forward under torch.autocast and don't .half() trainable modules;
#   https://github.com/tloen/alpaca-lora/issues/203)
# reproduces: nothing - a conv + BatchNorm classifier with fp32 parameters trained under fp16 autocast with a
#   GradScaler (BatchNorm stays fp32 under autocast).
# expect: quiet
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 4, (32,))
for step in range(15):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f}")
