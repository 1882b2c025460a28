"""The whole model is cast to bf16 and trained with no fp32 master copy: an AdamW step of about lr = 1e-4 is below
half an ulp of a LayerNorm gain of 1.0 (2**-8 in bf16), so those gains never move, and nothing raises."""
# reproduces: https://github.com/pytorch/ao/pull/1124 ("full bf16" training loses small updates)
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1)).to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
x = torch.randn(256, 16, dtype=torch.bfloat16)
y = x[:, :1].float() * 2.0 - x[:, 1:2].float()
gain = model[1].weight.detach().clone()
for step in range(20):
    loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"loss {loss.item():.4f}; LayerNorm gain unchanged: {torch.equal(model[1].weight, gain)}")
