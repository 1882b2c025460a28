"""The GradScaler is pinned to a loss scale of 1 (to stop it skipping steps) while the loss is a small auxiliary
term: under fp16 autocast its gradients land among fp16's subnormals (below 2**-14), which keep few significant bits
and round the smaller values to 0."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)  # a fixed scale of 1: no scaling
x = torch.randn(256, 64)
for step in range(5):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = 1e-3 * model(x).float().pow(2).mean()  # a regulariser, weighted 1e-3
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"loss {loss.item():.3g}, loss scale {scaler.get_scale():g}")
