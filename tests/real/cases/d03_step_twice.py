# source: failures.md row 20 (HorizonRobotics/alf PR #1770, Azure/MS-AMP PR #45, neosr PR #9; no URL given there)
# reproduces: two losses (generator-style), each followed by scaler.step(opt) on the same optimizer before a
#   single update() -> RuntimeError: step() has already been called since the last update().
# expect: AMP404
import torch
from torch import nn

torch.manual_seed(0)
model = nn.ModuleDict({"enc": nn.Linear(16, 16), "dec": nn.Linear(16, 16)})
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(32, 16)
for step in range(4):
    for name in ("enc", "dec"):  # one loss per part, stepped separately
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model[name](x).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}")
