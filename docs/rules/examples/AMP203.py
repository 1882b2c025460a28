"""``Accelerator(mixed_precision="fp16")`` on a machine without a GPU: accelerate keeps saying 'fp16' but sets up
no autocast and no GradScaler, so the run trains in fp32 and tests nothing of the fp16 run to come."""
import torch
from accelerate import Accelerator
from torch import nn

torch.manual_seed(0)
accelerator = Accelerator(mixed_precision="fp16", cpu=True)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = accelerator.prepare(model, opt)
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    accelerator.backward(loss)
    opt.step()
print(f"mixed_precision={accelerator.mixed_precision!r}, output dtype {model(x).dtype}")
