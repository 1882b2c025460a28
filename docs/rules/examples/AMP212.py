"""A DeepSpeed engine trains in bf16 with ZeRO stage 2: DeepSpeed owns the mixed precision (its fp32 master
partitions), so ampdoctor's parameter, optimizer and scaler rules leave its objects alone and say so."""
# command: torchrun --nproc-per-node 1 -m ampdoctor run {script}
import logging
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on the CPU (gloo)
import deepspeed
import torch
from torch import nn

deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines carry timestamps
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
config = {"train_batch_size": 4, "steps_per_print": 10**6, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2}}
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
x, y = torch.randn(4, 16, dtype=torch.bfloat16), torch.randint(0, 4, (4,))
for step in range(3):
    loss = nn.functional.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
print(f"final loss {loss.item():.4f}")
