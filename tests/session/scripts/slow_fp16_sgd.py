"""A pure fp16 SGD loop that trains until it is stopped (SIGTERM), for the tests of the end of a run on SIGTERM.

python slow_fp16_sgd.py [own-handler]

With ``own-handler`` the script installs its own SIGTERM handler, which ends the loop and returns normally.
"""

import signal
import sys
import time

import torch
from torch import nn

stop = []
if sys.argv[1:] == ["own-handler"]:
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
torch.manual_seed(0)
model = nn.Linear(8, 4).half()   # trainable fp16 weights, a plain optimizer: AMP103 before the first step
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(100_000):
    loss = model(torch.randn(16, 8, dtype=torch.float16)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == 3:
        print("training", flush=True)   # the test sends SIGTERM from here on
    if stop:
        print(f"stopped by the script's own handler at step {step}", flush=True)
        break
    time.sleep(0.01)
