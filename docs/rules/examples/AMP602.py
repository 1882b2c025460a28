"""The model appends each sample's length, written by hand as ``sqrt(sum(h**2))``, and the batch is padded with
all-zero samples: the forward pass is finite (sqrt(0) = 0), but the derivative of sqrt at 0 is infinite, so the
backward pass makes the gradients NaN and the GradScaler skips every step."""
# command: ampdoctor run --activations {script}
import torch
from torch import nn


class WithLength(nn.Module):
    def forward(self, h):  # torch.linalg.vector_norm has a finite gradient at 0; this does not
        return torch.cat([h, h.pow(2).sum(-1, keepdim=True).sqrt()], dim=-1)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32, bias=False), WithLength(), nn.Linear(33, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
x[-4:] = 0.0  # padding: the batch is filled up with zeros
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
