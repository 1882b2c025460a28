"""A block whose weights came from bf16 training (where values far above 65504 are fine) is fine-tuned with fp16
autocast and a GradScaler: its forward pass overflows on every step, so every step is skipped and the scaler
halves the loss scale again and again, which cannot help."""
# reproduces: https://github.com/deepspeedai/DeepSpeed/issues/4017 ("Current loss scale already at minimum")
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.Linear(16, 1))
with torch.no_grad():
    model[0].weight.mul_(3000.0)  # fine in bf16 (max ~3e38); in fp16 the block's output passes 65504
    model[2].weight.mul_(3000.0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(20):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"loss {loss.item()} after 20 steps, loss scale {scaler.get_scale():g}")
