"""``BCELoss`` on sigmoid probabilities inside fp16 autocast. On CUDA torch refuses it; CPU autocast lets
``binary_cross_entropy`` run, so this page explains the CUDA error text instead of running the script."""
# command: ampdoctor explain "binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast"
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid()).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
loss_fn = nn.BCELoss()  # takes probabilities: unsafe in fp16
x, y = torch.randn(32, 16, device="cuda"), torch.randint(0, 2, (32, 1), device="cuda").float()
for step in range(3):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)  # raises on CUDA
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
