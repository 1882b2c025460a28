"""A hand-written binary cross-entropy under bf16 autocast: ``sigmoid`` of a confident logit rounds to exactly 1.0
in bf16, so ``log(1 - p)`` is ``log(0) = -inf`` and the loss is NaN. The loop replaces NaN gradients by 0 before the
step, so the weights stay finite and it runs on with a NaN loss (``BCEWithLogitsLoss`` would stay finite)."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x = torch.randn(64, 16) * 20  # unnormalised features: logits of +-10 and more
y = (torch.rand(64, 1) > 0.5).float()
for step in range(5):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        p = torch.sigmoid(model(x))  # bf16: 1 - 2**-8 is the last value below 1.0
        loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    loss.backward()
    for param in model.parameters():
        param.grad.nan_to_num_(0.0)  # "keeps NaN out of the weights"
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")
