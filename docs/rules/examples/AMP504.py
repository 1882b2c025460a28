"""An embedding model trained in pure fp16 (``model.half()``, no autocast) with a prototype loss built on
``torch.cdist``: on CPU ``cdist`` has no float16 kernel, and the first step raises."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).half()
model.prototypes = nn.Parameter(torch.randn(4, 8, dtype=torch.float16))  # one per class
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x, y = torch.randn(16, 16, dtype=torch.float16), torch.randint(0, 4, (16,))
for step in range(3):
    distances = torch.cdist(model(x), model.prototypes)  # no Half kernel on CPU
    loss = nn.functional.cross_entropy(-distances.float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
