# source: https://github.com/pytorch/pytorch/issues/127176 (failures.md row 12, section 5)
# reproduces: a model cast with .to(torch.bfloat16) (a bf16 checkpoint on a GPU without bf16) trained with fp16
#   autocast and an fp16 GradScaler. On CUDA the unscale kernel raises "_amp_foreach_non_finite_check_and_unscale_cuda"
#   not implemented for 'BFloat16'; the CPU kernel accepts bf16 (failures.md section 5), so on CPU the run goes on
#   and shows the silent half: bf16 weights without fp32 master weights lose the updates (lr=1e-4).
# expect: AMP102
# fix: finishes
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(128, 16)
y = x[:, :1] * 3.0
first = model[0].weight.detach().clone()
for step in range(20):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print(f"final loss {loss.item():.4f}")
frozen = (model[0].weight.detach() == first).float().mean().item()
print(f"{frozen:.0%} of the first layer's weights never changed")
if frozen > 0.5:
    sys.exit(f"SYMPTOM: {frozen:.0%} of the first layer never moved in 20 AdamW steps (bf16 updates rounded away)")
