# source: https://github.com/huggingface/diffusers/pull/6208
# also: https://github.com/huggingface/diffusers/issues/9628 (failures.md row 32)
# reproduces: the frozen VAE-like encoder is cast to fp16 (weight_dtype) while the pixel values stay fp32 and the
#   encode runs outside torch.autocast -> RuntimeError: Input type (float) and bias type (c10::Half) should be
#   the same
# expect: AMP501
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
    latents = vae(pixels)  # no autocast, no pixels.to(weight_dtype)
    noise = torch.randn_like(latents.float())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(unet(latents + noise).float(), noise)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
