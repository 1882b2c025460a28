# source: https://github.com/huggingface/accelerate/issues/328 (failures.md row 21)
# reproduces: the optimizer is built over the parameters of one model object, then the script replaces the model
#   (reloads it from a checkpoint) and trains the new one: no optimizer parameter ever gets a .grad
#   -> AssertionError: No inf checks were recorded for this optimizer.
# expect: AMP406 AMP301
import torch
from torch import nn


def make():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


torch.manual_seed(0)
model = make()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
state = {k: v.clone() for k, v in model.state_dict().items()}
model = make()  # "load the pretrained weights" into a fresh object after the optimizer was created
model.load_state_dict(state)
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
