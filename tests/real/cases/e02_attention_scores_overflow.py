# source: https://github.com/huggingface/transformers/pull/17306 (failures.md row 28)
# reproduces: self-attention computed in fp16 under autocast: the QK^T scores of large hidden states overflow
#   65504 -> inf -> softmax gives NaN -> NaN loss; the first non-finite module is the attention block.
# ampdoctor-args: --activations
# expect: AMP601
# expect-detail: AMP601 ^attn\b
import sys

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, h):
        scores = self.q_proj(h) @ self.k_proj(h).transpose(-1, -2)  # no 1/sqrt(d), no fp32 upcast
        return torch.softmax(scores, dim=-1) @ self.v_proj(h)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.embed, self.attn, self.head = nn.Embedding(50, dim), Attention(dim), nn.Linear(dim, 50)

    def forward(self, ids):
        return self.head(self.attn(self.embed(ids) * 300.0))  # large hidden states (unnormalised residual stream)


torch.manual_seed(0)
model = Block(64)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
ids = torch.randint(0, 50, (4, 16))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: loss = {loss.item()}, scale {scaler.get_scale():g}")
