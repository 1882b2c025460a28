# source: https://github.com/kohya-ss/sd-scripts/issues/1914
# also: https://github.com/kohya-ss/sd-scripts/issues/1707 , https://github.com/JIA-Lab-research/ControlNeXt/issues/64
#   (failures.md rows 14 and 15)
# reproduces: --full_fp16: the scaler's _unscale_grads_ is patched to pass allow_fp16=True (kohya's
#   patch_accelerator_for_fp16_training), so fp16 LoRA weights train with no error and no fp32 master copy. AdamW's
#   eps=1e-8 is 0 in fp16 and lora_down's first gradient is exactly 0 (lora_up starts at 0): 0/0 = NaN, then
#   avr_loss=nan and every later step is skipped.
# expect: AMP104 AMP103
# expect-detail: AMP103 patched to accept float16 gradients
# expect-detail: AMP601 weights hold inf/NaN
# fix: finishes
import sys

import torch
from torch import nn

torch.manual_seed(0)
base = nn.Linear(64, 64).half().requires_grad_(False)
down = nn.Linear(64, 4, bias=False).half()   # lora_down (kaiming init)
up = nn.Linear(4, 64, bias=False).half()     # lora_up starts at zero
nn.init.zeros_(up.weight)
model = nn.ModuleDict({"base": base, "lora_down": down, "lora_up": up})
opt = torch.optim.AdamW([down.weight, up.weight], lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
original = scaler._unscale_grads_
scaler._unscale_grads_ = lambda opt_, inv, found, allow_fp16: original(opt_, inv, found, True)  # the patch
x, y = torch.randn(32, 64), torch.randn(32, 64)
for step in range(10):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model["base"](x) + model["lora_up"](model["lora_down"](x))
        loss = nn.functional.mse_loss(out.float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} avr_loss={loss.item():.4f}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: avr_loss={loss.item()} after 10 steps, loss scale {scaler.get_scale()}")
