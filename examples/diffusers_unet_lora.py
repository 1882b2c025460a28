"""LoRA on a diffusers UNet, fp16, with a validation step that undoes the fp32 upcast of the adapters.

The set-up is diffusers' ``examples/text_to_image/train_text_to_image_lora.py``: the frozen UNet is cast to
float16, peft LoRA adapters go on the attention projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``) with
``unet.add_adapter``, and ``diffusers.training_utils.cast_training_params(unet, dtype=torch.float32)`` upcasts the
adapters so that the GradScaler can unscale their gradients. Training under fp16 autocast works. Then a validation
step moves the UNet to float16 for inference (``unet.to(torch.float16)``, what a pipeline built with
``torch_dtype=torch.float16`` or a resume from an fp16 checkpoint also does). That casts the adapters back to
float16, and the next training step stops with ``ValueError: Attempting to unscale FP16 gradients.``

    ampdoctor run examples/diffusers_unet_lora.py         # explains the crash, naming the adapters
    ampdoctor run --fix examples/diffusers_unet_lora.py   # re-applies the upcast after the validation; trains

The UNet is tiny (block channels 32/64, sample size 8) and built from a config: nothing is downloaded. CPU, ~15 s.
"""
import torch
from diffusers import UNet2DConditionModel
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
from torch import nn

torch.manual_seed(0)
unet = UNet2DConditionModel(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
)
unet.requires_grad_(False)
unet.to(torch.float16)                                   # weight_dtype = torch.float16 for the frozen weights
unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                            target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
cast_training_params(unet, dtype=torch.float32)         # only the trainable adapters back to float32
optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-3)
scaler = torch.amp.GradScaler("cpu")

latents = torch.randn(4, 4, 8, 8)                        # stand-ins for VAE latents and text embeddings
text = torch.randn(4, 6, 32)


def validate():
    unet.eval()
    with torch.no_grad():
        unet.to(torch.float16)                           # inference in half precision, on the live model
        sample = unet(latents[:1].half(), torch.tensor([10]), text[:1].half()).sample
    unet.train()
    print(f"validation: sample std {sample.float().std().item():.4f}")


for step in range(6):
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 1000, (latents.shape[0],))
    noisy = latents + noise * (timesteps.view(-1, 1, 1, 1) / 1000)   # a toy noise schedule
    with torch.autocast("cpu", dtype=torch.float16):
        pred = unet(noisy, timesteps, text).sample
        loss = nn.functional.mse_loss(pred.float(), noise.float())
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                           # after the validation: Attempting to unscale FP16 gradients.
    nn.utils.clip_grad_norm_([p for p in unet.parameters() if p.requires_grad], 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    print(f"step {step}  loss {loss.item():.4f}")
    if step == 2:
        validate()
print("done")
