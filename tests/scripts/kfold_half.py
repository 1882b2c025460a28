"""k-fold cross-validation: a fresh model (cast with .half()) and optimizer per fold, in one process."""
import torch
from torch import nn

torch.manual_seed(0)
for fold in range(2):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(4):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        print(f"fold {fold} loss {loss.item():.6f}")
