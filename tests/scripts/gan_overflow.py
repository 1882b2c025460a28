"""A GAN's two-step loop under one fp16 GradScaler (the critic on a detached fake batch, then the generator through
the critic), shaped like pytorch/examples dcgan/main.py with small linear models. The argument picks what goes
wrong: ``generator`` (netG's last layer overflows fp16, and its fake batch feeds netD), ``critic`` (netD's last
layer overflows) or ``data`` (a NaN in the noise fed to netG)."""
import sys

import torch
from torch import nn

fault = sys.argv[1] if len(sys.argv) > 1 else "generator"
torch.manual_seed(0)
netG = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
netD = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
with torch.no_grad():
    if fault == "generator":
        netG[2].weight.mul_(1e5)   # fine in fp32, above 65504 in fp16
    elif fault == "critic":
        netD[2].weight.mul_(1e6)
optimizerD = torch.optim.Adam(netD.parameters(), lr=1e-3)
optimizerG = torch.optim.Adam(netG.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(12):
    noise = torch.randn(8, 8)
    if fault == "data":
        noise[0, 0] = float("nan")
    with torch.autocast("cpu", dtype=torch.float16):
        fake = netG(noise)
        lossD = netD(fake.detach()).float().mean()
    optimizerD.zero_grad()
    scaler.scale(lossD).backward()
    scaler.step(optimizerD)
    with torch.autocast("cpu", dtype=torch.float16):
        lossG = -netD(fake).float().mean()
    optimizerG.zero_grad()
    scaler.scale(lossG).backward()
    scaler.step(optimizerG)
    scaler.update()
print("done", lossD.item(), lossG.item())
