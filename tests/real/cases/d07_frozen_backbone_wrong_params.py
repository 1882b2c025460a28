# source: https://github.com/huggingface/accelerate/issues/328 (failures.md row 21 and section 6 recipe (3))
# reproduces: every parameter frozen except the head, but the optimizer was given the (frozen) backbone's
#   parameters: none of them gets a gradient -> AssertionError: No inf checks were recorded for this optimizer.
# expect: AMP406 AMP302
import torch
from torch import nn

torch.manual_seed(0)
model = nn.ModuleDict({"backbone": nn.Sequential(nn.Linear(16, 32), nn.ReLU()), "head": nn.Linear(32, 2)})
for p in model.parameters():
    p.requires_grad_(False)
model["head"].requires_grad_(True)
opt = torch.optim.AdamW(model["backbone"].parameters(), lr=1e-3)  # wrong params
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randint(0, 2, (32,))
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model["head"](model["backbone"](x)).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
