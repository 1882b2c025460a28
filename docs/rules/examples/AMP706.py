"""A LoRA-style layer adds its low-rank update in place, ``out.addmm_(x, delta)``: autocast casts the inputs of
out-of-place matmuls only, so under bf16 autocast this matmul computes in fp32, at fp32 speed and memory."""
# command: ampdoctor run --audit {script}
# reproduces: https://github.com/pytorch/pytorch/issues/91581 (autocast does not apply to in-place and out= ops)
import torch
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, dim, rank=4):
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.a, self.b = nn.Parameter(torch.randn(dim, rank) * 0.01), nn.Parameter(torch.zeros(rank, dim))

    def forward(self, x):
        out = self.base(x).float()
        return out.addmm_(x.float(), (self.a @ self.b).float())   # in place: autocast does not cast it


torch.manual_seed(0)
model = nn.Sequential(LoRALinear(64), nn.GELU(), nn.Linear(64, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(32, 64)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"loss {loss.item():.4f}")
