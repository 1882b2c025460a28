# source: failures.md section 6 ("Fix summary": scale(loss).backward -> unscale_ -> clip -> step -> update) and
#   section 3 (fp32 parameters, fp16 compute under torch.autocast); the fix the threads converge on
# reproduces: nothing - the canonical fp16 AMP loop on CPU: fp32 model, fp16 autocast, GradScaler("cpu"),
#   unscale_ before clipping, step, update.
# expect: quiet
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(128, 32)
y = x[:, :1] * 2.0 - x[:, 1:2]
for step in range(30):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f}")
