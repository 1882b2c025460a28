# source: https://github.com/huggingface/diffusers/blob/main/examples/research_projects/autoencoderkl/train_autoencoderkl.py
#   (AutoencoderKL training: encode -> latent_dist.sample() -> decode, mse_loss on .float(), KL summed per
#   sample with kl_scale 1e-6, clipping)
# reproduces: nothing - a diffusers AutoencoderKL from a tiny config kept in fp32 (not cast to weight_dtype) and
#   trained under bf16 autocast (no scaler): reconstruction MSE + small KL (the posterior taken in fp32), AdamW.
# expect: quiet
# ampdoctor-args: --audit-every
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

torch.manual_seed(0)
vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
                    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
                    layers_per_block=1, norm_num_groups=32, sample_size=32)
vae.train()
opt = torch.optim.AdamW(vae.parameters(), lr=1e-4)
pixel_values = torch.rand(4, 3, 32, 32) * 2 - 1  # images normalized to [-1, 1]
for step in range(4):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moments = vae.encode(pixel_values).latent_dist.parameters
    posterior = DiagonalGaussianDistribution(moments.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reconstructions = vae.decode(posterior.sample()).sample
    rec_loss = F.mse_loss(reconstructions.float(), pixel_values.float(), reduction="none")
    nll_loss = rec_loss.sum() / rec_loss.shape[0]
    kl_loss = posterior.kl().sum() / rec_loss.shape[0]
    loss = nll_loss + 1e-6 * kl_loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
    opt.step()
    assert torch.isfinite(loss)
    print(f"step {step} loss {loss.item():.2f} (rec {nll_loss.item():.2f}, kl {kl_loss.item():.1f})")
