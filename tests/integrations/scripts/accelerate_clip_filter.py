"""A LoRA-style loop clipped through ``accelerator.clip_grad_norm_`` over a consumed ``filter``, as diffusers'
``examples/text_to_image/train_text_to_image_lora.py`` writes it (``params_to_optimize = filter(lambda p:
p.requires_grad, unet.parameters())``, handed to the optimizer, then to ``accelerator.clip_grad_norm_``). Written
for the tests.

accelerate 1.x clips through ``get_total_norm`` + ``clip_grads_with_norm_`` and, over no parameters, calls no
torch clip at all: only the wrapper returns its (zero) norm. Argument 1: ``filter`` (the bug) or ``list`` (the fix);
argument 2: max_grad_norm.
"""

import sys

import torch
from accelerate import Accelerator
from torch import nn

kind, max_norm = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
accelerator = Accelerator(cpu=True)
base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
base.requires_grad_(False)
model = nn.Sequential(base, nn.Linear(4, 4))
trainable = filter(lambda p: p.requires_grad, model.parameters())
if kind == "list":
    trainable = list(trainable)
optimizer = torch.optim.AdamW(trainable, lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(12):
    x, y = torch.randn(8, 16), torch.randn(8, 4) * 10
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    accelerator.backward(loss)
    if accelerator.sync_gradients:
        accelerator.clip_grad_norm_(trainable, max_norm)
    optimizer.step()
    optimizer.zero_grad()
