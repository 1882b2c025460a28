"""A diffusion training step casts its timesteps to the weights' dtype (``timesteps.to(dtype=weight_dtype)``) before
the sinusoidal embedding: in bf16, 999 becomes 1000 and 997 becomes 996, so neighbouring timesteps get the same
embedding."""
# command: ampdoctor run --audit {script}
# reproduces: https://github.com/huggingface/diffusers/issues/4397 (timesteps cast to bf16 lose precision)
import math

import torch
from torch import nn


def timestep_embedding(t, dim=32):
    freqs = torch.exp(-math.log(10000) * torch.arange(dim // 2, dtype=torch.float32) / (dim // 2))
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


torch.manual_seed(0)
denoiser = nn.Sequential(nn.Linear(32 + 16, 64), nn.SiLU(), nn.Linear(64, 16))
opt = torch.optim.AdamW(denoiser.parameters(), lr=1e-3)
for step in range(4):
    x = torch.randn(8, 16)
    timesteps = torch.randint(900, 1000, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t = timesteps.to(dtype=torch.bfloat16)          # weight_dtype: 999 -> 1000
        pred = denoiser(torch.cat([x, timestep_embedding(t).to(x.dtype)], dim=-1))
        loss = nn.functional.mse_loss(pred.float(), x)
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"loss {loss.item():.4f}")
