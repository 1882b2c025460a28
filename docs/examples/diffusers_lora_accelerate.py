"""LoRA on a diffusers UNet through accelerate, fp16: the validation step undoes the adapters' fp32 upcast.

The shape of diffusers' ``examples/text_to_image/train_text_to_image_lora.py``, tiny and on a CPU: an
``Accelerator(mixed_precision="fp16")``, the frozen UNet cast to ``weight_dtype`` (float16), peft LoRA adapters
added with ``unet.add_adapter``, ``cast_training_params(unet, dtype=torch.float32)`` for the trainable adapters,
then ``accelerator.prepare``, ``accelerator.backward`` and ``accelerator.clip_grad_norm_``. After step 2 a
validation moves the live UNet to ``weight_dtype`` for inference (diffusers issue 13124), which casts the adapters
back to float16, and the next ``accelerator.clip_grad_norm_`` raises ``ValueError: Attempting to unscale FP16
gradients.``

    ampdoctor run docs/examples/diffusers_lora_accelerate.py         # names the adapters, explains the crash
    ampdoctor run --fix docs/examples/diffusers_lora_accelerate.py   # upcasts them again; trains to the end

On a GPU this is plain ``Accelerator(mixed_precision="fp16")``. accelerate turns fp16 off on a CPU without a word
(AMP203), so on a CPU the script sets up what the GPU path sets up, before ``prepare``: ``native_amp = True``
(``prepare`` wraps the forward in fp16 autocast) and a ``GradScaler("cpu")``. The UNet is built from a config:
nothing is downloaded. CPU, about 15 s.
"""
import torch
from accelerate import Accelerator
from diffusers import UNet2DConditionModel
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
from torch import nn

accelerator = Accelerator(mixed_precision="fp16", cpu=True)
if accelerator.device.type == "cpu" and accelerator.scaler is None:
    accelerator.native_amp = True                        # what accelerate sets up for fp16 on a GPU
    accelerator.scaler = torch.amp.GradScaler("cpu")
weight_dtype = torch.float16

torch.manual_seed(0)
unet = UNet2DConditionModel(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
)
unet.requires_grad_(False)
unet.to(accelerator.device, dtype=weight_dtype)          # the frozen weights in half precision
unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                            target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
cast_training_params(unet, dtype=torch.float32)         # only the trainable adapters back to float32
lora_layers = [p for p in unet.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(lora_layers, lr=1e-3)
unet, optimizer = accelerator.prepare(unet, optimizer)

latents = torch.randn(4, 4, 8, 8)                        # stand-ins for VAE latents and text embeddings
text = torch.randn(4, 6, 32)


def log_validation():
    unet.eval()
    with torch.no_grad():
        unet.to(dtype=weight_dtype)                      # the pipeline in weight_dtype, on the live model
        sample = unet(latents[:1].half(), torch.tensor([10]), text[:1].half()).sample
    unet.train()
    print(f"validation: sample std {sample.float().std().item():.4f}")


for step in range(6):
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 1000, (latents.shape[0],))
    noisy = latents + noise * (timesteps.view(-1, 1, 1, 1) / 1000)   # a toy noise schedule
    pred = unet(noisy, timesteps, text).sample
    loss = nn.functional.mse_loss(pred.float(), noise.float())
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(lora_layers, 1.0)        # after the validation: Attempting to unscale FP16 gradients.
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}  loss {loss.item():.4f}")
    if step == 2:
        log_validation()
print("done")
