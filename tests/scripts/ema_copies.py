"""Averaged weights kept outside the optimizer, in the styles of the public training scripts (written for the tests):

* ``swa-bf16``: a pure-bf16 model with ``torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=
  get_ema_multi_avg_fn(0.999))``, updated after each step (torch's SWA/EMA utilities; timm-style model EMA). The
  average is a deep copy, so bf16 too: its updates round away.
* ``swa-fp32``: the same loop with fp32 weights under bf16 autocast: the healthy control.
* ``ema-bf16``: diffusers' ``EMAModel(unet.parameters())`` as ``train_text_to_image.py`` builds it, then moved with
  ``ema.to(device, dtype=torch.bfloat16)`` to save memory; ``ema.step(model.parameters())`` after each step.
* ``ema-fp32``: the EMA left in fp32: the healthy control.

Argument 2: where to save the averaged weights (optional).
"""

import sys

import torch
from torch import nn

kind = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
if kind == "swa-bf16":
    model = model.bfloat16()
if kind.startswith("swa"):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
else:
    from diffusers.training_utils import EMAModel
    average = EMAModel(model.parameters(), decay=0.999, min_decay=0.999)
    if kind == "ema-bf16":
        average.to("cpu", dtype=torch.bfloat16)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
dtype = next(model.parameters()).dtype
for step in range(24):
    x, y = torch.randn(16, 32, dtype=dtype), torch.randn(16, 8, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if kind.startswith("swa"):
        average.update_parameters(model)
    else:
        average.step(model.parameters())
if len(sys.argv) > 2:
    weights = list(average.parameters()) if kind.startswith("swa") else average.shadow_params
    torch.save([w.detach().float() for w in weights], sys.argv[2])
