"""A layer with large weights feeds a LayerNorm under fp16 autocast: the loss is fine and training goes on, but that
layer's outputs already reach 30000, nearly half of fp16's largest value (65504): a little growth away from inf."""
# command: ampdoctor run --activations {script}
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 1))
with torch.no_grad():
    model[2].weight.mul_(30000.0)  # as a badly scaled checkpoint might hold
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(10):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}")
