"""The second layer's weights are large (as a bf16-pretrained checkpoint's can be) and the model is fine-tuned
under fp16 autocast: that layer's output passes 65504, becomes inf, and the loss is NaN on every step."""
# reproduces: https://github.com/huggingface/transformers/issues/14189 (T5's FFN `wo` overflows in fp16)
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
with torch.no_grad():
    model[2].weight.mul_(100000.0)  # its outputs pass 65504, fp16's largest value
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(32, 16), torch.randn(32, 1)
for step in range(10):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
