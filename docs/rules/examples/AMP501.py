"""A frozen encoder is cast to fp16 (to save memory) while its inputs stay fp32, and it runs outside
``torch.autocast``: the convolution refuses an fp32 input with fp16 weights."""
# reproduces: https://github.com/huggingface/diffusers/pull/6208
import torch
from torch import nn

torch.manual_seed(0)
vae = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.SiLU(), nn.Conv2d(8, 4, 3, padding=1))
vae.requires_grad_(False).to(dtype=torch.float16)
unet = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 4, 3, padding=1))
opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
pixels = torch.randn(2, 3, 32, 32)
for step in range(3):
    latents = vae(pixels)  # no autocast, no pixels.to(torch.float16)
    noise = torch.randn_like(latents.float())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(unet(latents + noise).float(), noise)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
