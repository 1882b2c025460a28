"""Actor and critic, two separate modules, trained by one optimizer under fp16 AMP (a correct setup)."""
import torch
from torch import nn

torch.manual_seed(0)
actor = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 2))
critic = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.Adam(list(actor.parameters()) + list(critic.parameters()), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(5):
    obs = torch.randn(8, 6)
    with torch.autocast("cpu", dtype=torch.float16):
        logits, value = actor(obs), critic(obs)
        loss = -logits.float().log_softmax(-1)[:, 0].mean() + value.float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    print(f"loss {loss.item():.6f}")
