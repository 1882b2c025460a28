"""Two models, two optimizers, one GradScaler: "Working with Multiple Models, Losses, and Optimizers" of the PyTorch
AMP examples (docs/source/notes/amp_examples.rst), on CPU."""
import torch
from torch import nn

torch.manual_seed(0)
model0 = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
model1 = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer0 = torch.optim.SGD(model0.parameters(), lr=1e-3)
optimizer1 = torch.optim.SGD(model1.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for epoch in range(12):
    input, target = torch.randn(8, 16), torch.randn(8, 1)
    optimizer0.zero_grad()
    optimizer1.zero_grad()
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        output0 = model0(input)
        output1 = model1(input)
        loss0 = nn.functional.mse_loss(2 * output0.float().mean(1, keepdim=True) + 3 * output1.float(), target)
        loss1 = nn.functional.mse_loss(3 * output0.float().mean(1, keepdim=True) - 5 * output1.float(), target)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.unscale_(optimizer0)
    scaler.step(optimizer0)
    scaler.step(optimizer1)
    scaler.update()
print("done", loss0.item())
