"""A latent-diffusion training loop in the shape of diffusers' examples/text_to_image/train_text_to_image_lora.py: a
frozen float16 VAE encodes each batch under no_grad (``vae.encode()`` calls ``vae.encoder`` directly), and a small
denoiser trains on the latents under fp16 autocast and a GradScaler. The VAE encoder's last convolution overflows
fp16, as SDXL's VAE does in float16 (the reason for madebyollin/sdxl-vae-fp16-fix): the latents are inf/NaN, every
step is skipped, and the denoiser only carries them along."""
import torch
from diffusers import AutoencoderKL
from torch import nn

torch.manual_seed(0)
vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                    up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                    latent_channels=4, norm_num_groups=32, sample_size=32)
with torch.no_grad():
    vae.encoder.conv_out.weight.mul_(1e5)   # finite in fp16 (at most 4.2e3); its outputs are not
vae.requires_grad_(False)
vae = vae.half()
denoiser = nn.Sequential(nn.Conv2d(4, 32, 3, padding=1), nn.SiLU(), nn.Conv2d(32, 4, 3, padding=1))
optimizer = torch.optim.AdamW(denoiser.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
for step in range(12):
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        latents = vae.encode(pixels.half()).latent_dist.sample().float() * 0.18215
    noise = torch.randn_like(latents)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(denoiser(latents + noise).float(), noise)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print("done", loss.item())
