"""DreamBooth-style: one optimizer over a float32 model and a second model left in float16 (the text encoder that
cast_training_params was not given), fp16 autocast and a GradScaler: the first unscale_() raises."""
import torch
from torch import nn

torch.manual_seed(0)
unet = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
text_encoder = nn.Sequential(nn.Linear(8, 8)).half()
opt = torch.optim.AdamW([*unet.parameters(), *text_encoder.parameters()], lr=1e-3, eps=1e-4)
scaler = torch.amp.GradScaler("cpu")
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = unet(text_encoder(torch.randn(4, 8).half())).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
