# source: failures.md section 1.3 ("Consequence (inferred from source): with fused=True ... fp16 parameters do not
#   trigger the ValueError. The first unscale_() call does, for example the one inside HF Trainer's clipping")
#   and failures.md row 1 (https://github.com/huggingface/transformers/issues/23165)
# reproduces: a .half() model with a fused AdamW and a GradScaler trains silently in pure fp16 (no error); when
#   gradient clipping is switched on at step 5 the first scaler.unscale_() raises
#   ValueError: Attempting to unscale FP16 gradients.
# expect: AMP105 AMP101
# fix: finishes
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).half()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, fused=True)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 32)
y = x[:, :1] * 2.0
for step in range(10):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    if step >= 5:  # e.g. max_grad_norm kicks in after warm-up
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss), f"non-finite loss at step {step}"
    print(f"step {step} loss {loss.item():.4f}")
