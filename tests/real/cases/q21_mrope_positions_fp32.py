# source: https://github.com/huggingface/diffusers/issues/13920
# reproduces: nothing - the multi-axis rotary model, the 65536-offset image positions and the bf16 autocast loop of
#   n09, with autocast disabled around inv_freq @ positions (the fix of diffusers#13922), so the positions stay fp32.
# expect: quiet
# ampdoctor-args: --audit
import torch
import torch.nn.functional as F
from torch import nn

OFFSET = 65536


class MRoPE(nn.Module):
    def __init__(self, dim, theta=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, position_ids):  # (L, 3) -> angles (L, 3 * dim)
        pos = position_ids.T.to(torch.float32)[:, None, :]  # (3, 1, L)
        with torch.autocast(position_ids.device.type, enabled=False):
            freqs = self.inv_freq.to(torch.float32)[None, :, None] @ pos
        return freqs.permute(2, 0, 1).flatten(1).repeat_interleave(2, dim=-1)


class Model(nn.Module):
    def __init__(self, vocab=32, dim=48):
        super().__init__()
        self.embed, self.qkv, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)
        self.rope = MRoPE(dim // 3)

    def forward(self, ids, position_ids):
        q, k, v = self.qkv(self.embed(ids)).chunk(3, dim=-1)
        ang = self.rope(position_ids)
        rot = [torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) for x in (q, k)]
        q, k = q * ang.cos() + rot[0] * ang.sin(), k * ang.cos() + rot[1] * ang.sin()
        return self.head(F.scaled_dot_product_attention(q, k, v))


grid = torch.stack(torch.meshgrid(torch.arange(1), torch.arange(8), torch.arange(8), indexing="ij"), -1).view(-1, 3)
position_ids = torch.cat([torch.arange(16)[:, None].expand(-1, 3), OFFSET + grid])  # 16 text + 64 image tokens
torch.manual_seed(0)
model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids, target = torch.randint(0, 32, (4, 80)), torch.randint(0, 32, (4, 80))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids, position_ids).flatten(0, 1).float(), target.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
with torch.autocast("cpu", dtype=torch.bfloat16):
    distinct = model.rope(position_ids)[16:].unique(dim=0).shape[0]
assert distinct == 64
print(f"final loss {loss.item():.4f}")
