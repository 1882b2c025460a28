"""A pooling layer sums the token features of a long sequence one token at a time, in the bf16 of autocast: each
addition rounds to bf16 on its own, and after 1024 of them the sum is far from the same sum in fp32."""
# command: ampdoctor run --audit {script}
# reproduces: https://github.com/pytorch/pytorch/issues/99064 (a running sum in bf16 loses precision)
import torch
from torch import nn


class SumPool(nn.Module):
    def forward(self, x):
        total = torch.zeros_like(x[:, 0])
        for i in range(x.shape[1]):          # a running sum in x.dtype: each step rounds to bf16
            total = total + x[:, i]
        return total / x.shape[1]


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Softplus(), SumPool(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 1024, 16)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"loss {loss.item():.4f}")
