"""Two losses (one per part of the model), each followed by ``scaler.step(opt)`` on the same optimizer before a
single ``scaler.update()``: the second ``step()`` raises."""
# reproduces: failures.md row 20 (two losses stepped on one optimizer)
import torch
from torch import nn

torch.manual_seed(0)
model = nn.ModuleDict({"enc": nn.Linear(16, 16), "dec": nn.Linear(16, 16)})
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(32, 16)
for step in range(3):
    for name in ("enc", "dec"):  # one loss per part, each stepped
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model[name](x).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
    scaler.update()
