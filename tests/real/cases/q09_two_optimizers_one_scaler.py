# source: failures.md section 1.7 ("Several optimizers share one scaler: call step for each, then update()
#   once") and row 20 (the fix for step() called twice)
# reproduces: nothing - a GAN-style loop: two models, two optimizers, one GradScaler, one update() per iteration.
# expect: quiet
import torch
from torch import nn

torch.manual_seed(0)
gen, disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), nn.Sequential(nn.Linear(8, 1))
opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=1e-3), torch.optim.Adam(disc.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
bce = nn.functional.binary_cross_entropy_with_logits
for step in range(15):
    z, real = torch.randn(32, 8), torch.randn(32, 8) + 2.0
    with torch.autocast("cpu", dtype=torch.float16):
        fake = gen(z)
        d_loss = bce(disc(real).float(), torch.ones(32, 1)) + bce(disc(fake.detach()).float(), torch.zeros(32, 1))
    opt_d.zero_grad()
    scaler.scale(d_loss).backward()
    with torch.autocast("cpu", dtype=torch.float16):
        g_loss = bce(disc(fake).float(), torch.ones(32, 1))
    opt_g.zero_grad()
    scaler.scale(g_loss).backward()
    scaler.step(opt_d)
    scaler.step(opt_g)
    scaler.update()
assert torch.isfinite(d_loss) and torch.isfinite(g_loss)
print(f"d {d_loss.item():.3f} g {g_loss.item():.3f}")
