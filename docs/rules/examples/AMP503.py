"""Self-attention that masks its scores with ``-1e9``: under fp16 autocast the scores are float16, which holds
values only up to 65504, so ``masked_fill`` refuses the constant."""
import torch
from torch import nn

torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask, -1e9)  # fine in fp32; beyond fp16's range
        return self.out(scores.softmax(-1) @ v)


model = Attention()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, mask = torch.randn(4, 8, 16), torch.ones(8, 8, dtype=torch.bool).tril()
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x, mask).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
