# source: https://github.com/huggingface/accelerate/issues/641 (failures.md row 17: the accepted fix, clip only
#   `if accelerator.sync_gradients:`)
# reproduces: nothing - gradient accumulation over 4 micro-batches, unscale_ + clipping once per optimizer step.
# expect: quiet
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
accum = 4
data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(32)]
for i, (x, y) in enumerate(data):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y) / accum
    scaler.scale(loss).backward()
    if (i + 1) % accum == 0:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
assert torch.isfinite(loss)
print(f"last micro-batch loss {loss.item():.4f}")
