# source: failures.md section 0 and section 1.4 ("RuntimeError: unscale_() is being called after step()":
#   clipping or unscaling placed after scaler.step(); no URL given there)
# reproduces: gradient clipping moved after scaler.step(opt) (for logging the grad norm)
#   -> RuntimeError: unscale_() is being called after step().
# expect: AMP403
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.unscale_(opt)  # to log the true grad norm
    print("grad norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
    scaler.update()
