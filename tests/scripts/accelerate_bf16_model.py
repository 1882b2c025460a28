"""accelerate with mixed_precision="bf16" on a model loaded in bfloat16: accelerate enters autocast inside forward."""
import torch
from accelerate import Accelerator
from torch import nn

torch.manual_seed(0)
accelerator = Accelerator(mixed_precision="bf16", cpu=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(torch.bfloat16)  # torch_dtype=bfloat16
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = accelerator.prepare(model, opt)
for step in range(5):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    loss = nn.functional.mse_loss(model(x).float(), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    print(f"loss {loss.item():.6f} weight dtype {next(model.parameters()).dtype}")
