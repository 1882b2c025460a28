# source: https://github.com/huggingface/accelerate/pull/1036 (failures.md row 40: "bf16 has an almost the same
#   dynamic range as fp32, so no scaling is needed")
# reproduces: nothing - fp32 parameters, bf16 autocast, no GradScaler.
# expect: quiet
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(128, 32)
y = x[:, :1] * 2.0 - x[:, 1:2]
for step in range(30):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f}")
