# source: https://github.com/huggingface/diffusers/issues/9405
# reproduces: nothing - the denoiser and the bf16 autocast flow-matching loop of n07, with the timesteps kept in fp32
#   (Timesteps builds the sinusoidal embedding in fp32; only the embedding MLP runs in bf16 under autocast).
# expect: quiet
# ampdoctor-args: --audit
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
model = Denoiser()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x0 = torch.randn(64, 16)
for step in range(8):
    noise, sigmas = torch.randn_like(x0), torch.rand(64)
    noisy = (1.0 - sigmas[:, None]) * x0 + sigmas[:, None] * noise
    timesteps = sigmas * 1000.0  # stays fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(noisy, timesteps).float(), noise - x0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f}")
