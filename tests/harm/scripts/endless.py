"""A training loop that runs until it is killed (at most MAX_SECONDS, so a test that forgets it cannot hang).

    python endless.py [MAX_SECONDS]

fp16 autocast, GradScaler("cpu"), AdamW; prints nothing. tests/harm/test_durability.py runs it under
`ampdoctor run --every 1 --log-dir DIR` and kills it with SIGKILL once the flight recorder holds a few steps.
"""
import sys
import time

import torch
from torch import nn

max_seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
deadline = time.monotonic() + max_seconds
step = 0
while time.monotonic() < deadline:
    x = torch.randn(32, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), x[:, :1])
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    step += 1
    time.sleep(0.005)  # a few hundred steps a second at most: the log grows, but not without bound
