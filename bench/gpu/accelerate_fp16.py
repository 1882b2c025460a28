"""accelerate with mixed_precision='fp16' on CUDA (its real GradScaler) and a classification head cast to fp16."""
import torch
from accelerate import Accelerator
from torch import nn

torch.manual_seed(0)
accelerator = Accelerator(mixed_precision="fp16")
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
model[2].half()  # the stray cast
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = accelerator.prepare(model, opt)
assert accelerator.scaler is not None, "accelerate built no GradScaler"
for step in range(10):
    x = torch.randn(32, 16, device=accelerator.device)
    y = torch.randint(0, 4, (32,), device=accelerator.device)
    loss = nn.functional.cross_entropy(model(x).float(), y)
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
print(f"done: loss {loss.item():.4f}, skipped last step: {accelerator.optimizer_step_was_skipped}")
