"""A LoRA-style loop passes its trainable parameters to the optimizer as a ``filter(...)`` and then clips that same
object: the optimizer already consumed the iterator, so ``clip_grad_norm_`` sees no parameters and never clips."""
# reproduces: the pattern of diffusers' train_text_to_image_lora.py (params_to_optimize = filter(...))
import torch
from torch import nn

torch.manual_seed(0)
base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
adapter = nn.Linear(4, 4)
base.requires_grad_(False)  # frozen: only the adapter trains
model = nn.Sequential(base, adapter)
trainable = filter(lambda p: p.requires_grad, model.parameters())
opt = torch.optim.AdamW(trainable, lr=1e-2)
for step in range(12):
    x, y = torch.randn(8, 16), torch.randn(8, 4) * 10
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm=0.01)  # an empty iterator by now
    opt.step()
    opt.zero_grad()
print(f"last clip_grad_norm_: {norm.item()}")
