# source: https://github.com/huggingface/transformers/issues/34053 (failures.md row 36, section 10)
# reproduces: run 1 (a separate `python` process, started here when no checkpoint exists) trains and saves the
#   model and optimizer but not the GradScaler; this run resumes from it: the scale restarts at 65536 instead
#   of the settled 2048, and the first steps after the resume are skipped.
# expect: AMP410
import os
import subprocess
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 16)
first_run = sys.argv[1:] == ["--first-run"]
if not first_run:
    if not os.path.exists("run1.pt"):
        subprocess.run([sys.executable, os.path.abspath(__file__), "--first-run"], check=True)
    ckpt = torch.load("run1.pt")
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])  # resumed: but the scaler starts again at 65536
skipped = 0
for step in range(10 if first_run else 8):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).sum()
    opt.zero_grad()
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped += scaler.get_scale() < scale
if first_run:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scale_was": scaler.get_scale()}, "run1.pt")
    sys.exit(0)
os.remove("run1.pt")
print(f"run 1 ended at scale {ckpt['scale_was']:g}; {skipped} steps skipped after the resume")
if skipped:
    sys.exit(f"SYMPTOM: resumed at scale 65536 instead of {ckpt['scale_was']:g}; {skipped} steps skipped")
