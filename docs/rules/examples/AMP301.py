"""The optimizer is built, then the model is re-created to load pretrained weights: the optimizer still holds the
old model's tensors, so nothing it steps is ever used, and the new model never trains."""
import torch
from torch import nn


def make():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


torch.manual_seed(0)
model = make()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
pretrained = {k: v.clone() for k, v in model.state_dict().items()}
model = make()  # a fresh object, after the optimizer was created
model.load_state_dict(pretrained)
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
