"""A ``.half()`` model with a fused AdamW and a GradScaler trains silently in pure fp16 (the fused kernel unscales
fp16 gradients without complaint); when clipping starts, the first ``scaler.unscale_()`` raises."""
# reproduces: https://github.com/huggingface/transformers/issues/23165
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, fused=True)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(4):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    if step >= 2:  # max_grad_norm switched on after warm-up
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}")
