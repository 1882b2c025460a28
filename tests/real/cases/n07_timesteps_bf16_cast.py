# source: https://github.com/huggingface/diffusers/issues/9405
# reproduces: flow-matching training of a small denoiser (diffusers Timesteps/TimestepEmbedding) under bf16 autocast,
#   the sampled timesteps (sigma * 1000) cast to weight_dtype=bf16 before the model as the Flux pipeline does: 998.39 ->
#   1000, 750 -> 752, so the model is conditioned on the wrong noise level (no error).
# expect: AMP704
# expect-detail: AMP704 aten\._to_copy\.default at n07_\w+\.py:36 \(forward, bfloat16\) casts float32\[64\]
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from torch import nn


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.time_proj, self.time_embed = Timesteps(32, True, 0), TimestepEmbedding(32, 64)
        self.net = nn.Sequential(nn.Linear(16 + 64, 64), nn.SiLU(), nn.Linear(64, 16))

    def forward(self, x, timesteps):
        temb = self.time_embed(self.time_proj(timesteps))
        return self.net(torch.cat([x, temb.to(x.dtype)], dim=-1))


torch.manual_seed(0)
weight_dtype = torch.bfloat16
model = Denoiser()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x0 = torch.randn(64, 16)
for step in range(8):
    noise, sigmas = torch.randn_like(x0), torch.rand(64)
    noisy = (1.0 - sigmas[:, None]) * x0 + sigmas[:, None] * noise
    t_fp32 = sigmas * 1000.0
    timesteps = t_fp32.to(dtype=weight_dtype)  # 998.39 -> 1000.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(noisy, timesteps).float(), noise - x0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
err = (timesteps.float() - t_fp32).abs()
if err.max() > 0.5:
    i = int(err.argmax())
    sys.exit(f"SYMPTOM: bf16 timesteps are off by up to {err.max():.2f} ({t_fp32[i]:.3f} -> {timesteps[i].item():g}); "
             f"{len(t_fp32)} sampled timesteps map to {timesteps.unique().numel()} distinct values")
