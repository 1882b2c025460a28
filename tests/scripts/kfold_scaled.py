"""k-fold cross-validation done right: a fresh fp32 model, optimizer and GradScaler per fold, under fp16 autocast."""
import torch
from torch import nn

torch.manual_seed(0)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for fold in range(3):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x).float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    print(f"fold {fold} loss {loss.item():.4f}")
