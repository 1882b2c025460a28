"""Some batches hold raw, unnormalised readings (values around 1e5, above fp16's largest value 65504): their forward
pass overflows under fp16 autocast and the GradScaler skips those steps, so those batches teach the model nothing."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
batches = [torch.randn(16, 8) for _ in range(40)]
for i in range(20, 25):
    batches[i][0] = 1e5  # a sensor's raw counts, where the others were normalised
for step, x in enumerate(batches):
    y = x.sum(1, keepdim=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"loss scale {scaler.get_scale():g} after 40 steps")
