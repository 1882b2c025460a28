# source: https://github.com/huggingface/diffusers/blob/main/examples/text_to_image/train_text_to_image.py (the
#   training step: DDPMScheduler.add_noise, int64 timesteps, epsilon target, mse_loss on .float(), clipping)
# reproduces: nothing - a diffusers UNet2DConditionModel from a tiny config (fp32 parameters) trained on the
#   standard noise-prediction MSE loss under bf16 autocast (accelerate's mixed_precision="bf16": no scaler), AdamW.
# expect: quiet
# ampdoctor-args: --audit-every
import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel

torch.manual_seed(0)
unet = UNet2DConditionModel(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
unet.train()
noise_scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                                beta_start=0.00085, beta_end=0.012)
opt = torch.optim.AdamW(unet.parameters(), lr=1e-4, weight_decay=1e-2)
latents = torch.randn(4, 4, 16, 16) * 0.18215  # vae latents times vae.config.scaling_factor
encoder_hidden_states = torch.randn(4, 8, 32)  # the frozen text encoder's output
for step in range(4):
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],)).long()
    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
    loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
    opt.step()
    assert torch.isfinite(loss)
    print(f"step {step} loss {loss.item():.4f}")
