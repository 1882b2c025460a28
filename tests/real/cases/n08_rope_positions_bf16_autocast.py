# source: https://github.com/huggingface/transformers/pull/29285
# reproduces: a small causal LM whose rotary embedding computes inv_freq @ positions with a matmul inside the bf16
#   autocast region (the Llama/Gemma code before the fix): autocast casts the fp32 positions to bf16, positions above
#   256 round to multiples of 2, 4, ..., and neighbouring tokens get identical rotary angles (no error).
# expect: AMP704
# expect-detail: AMP704 ^rotary \(Rotary\): aten\._to_copy.* n08_\w+\.py:21 .* whole numbers \(up to 510\)
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from torch import nn


class Rotary(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, position_ids):
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed, self.qkv, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)
        self.rotary = Rotary(dim)

    def forward(self, ids):
        q, k, v = self.qkv(self.embed(ids)).chunk(3, dim=-1)
        cos, sin = self.rotary(torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1))
        out = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.head(out)

torch.manual_seed(0)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 64, (2, 512))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
with torch.autocast("cpu", dtype=torch.bfloat16):
    cos, _ = model.rotary(torch.arange(512)[None])
distinct = cos[0].unique(dim=0).shape[0]
if distinct < 512:
    sys.exit(f"SYMPTOM: the 512 positions get only {distinct} distinct rotary tables under bf16 autocast "
             f"(positions > 256 are rounded before inv_freq @ positions); loss {loss.item():.4f}")
