"""A gradient clip over a consumed iterator, in the style of diffusers' ``train_text_to_image_lora.py`` (written for
the tests): the trainable parameters are passed to the optimizer as ``filter(...)`` and the same object to
``clip_grad_norm_``; the optimizer consumed it, so the clip sees no parameters.

``filter``: the bug; ``list``: the one-line fix. Argument 2: max_grad_norm; argument 3: where to save the weights.
"""

import sys

import torch
from torch import nn

kind, max_norm = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
adapter = nn.Linear(4, 4)
for p in base.parameters():
    p.requires_grad_(False)
model = nn.Sequential(base, adapter)
trainable = filter(lambda p: p.requires_grad, model.parameters())
if kind == "list":
    trainable = list(trainable)
opt = torch.optim.AdamW(trainable, lr=1e-2)
for step in range(12):
    x, y = torch.randn(8, 16), torch.randn(8, 4) * 10
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, max_norm)
    opt.step()
    opt.zero_grad()
if len(sys.argv) > 3:
    torch.save(adapter.state_dict(), sys.argv[3])
