"""The model trains in fp32 under bf16 autocast, but its EMA copy (diffusers' ``EMAModel``) was moved to bf16 to save
memory: each update moves the average by 0.1% of its gap to the model, below half a bf16 ulp, so it stays put."""
# reproduces: the EMA of diffusers' train_text_to_image.py, with ema_unet.to(device, dtype=weight_dtype)
import torch
from diffusers.training_utils import EMAModel
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
ema = EMAModel(model.parameters(), decay=0.999, min_decay=0.999)
ema.to("cpu", dtype=torch.bfloat16)  # "it is never trained, so bf16 is enough": the weights we evaluate and save
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(24):
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    ema.step(model.parameters())
print(f"loss {loss.item():.4f}")
