# source: https://github.com/huggingface/lerobot/pull/710
# reproduces: eager attention under fp16 autocast masks the scores with torch.where(mask, scores, -2.3819763e38);
#   the fill value becomes -inf in fp16, the query rows of padding tokens are fully masked, softmax of an all -inf
#   row is 0/0 = NaN, and the masked token loss (NaN * 0) is NaN at every step while the GradScaler halves the scale.
# expect: AMP701
# expect-detail: AMP701 ^attn \(Attention\): \w+=-2\.38198e\+38 is -inf in float16: .* n03_\w+\.py:26; NaN/inf
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from torch import nn

BIG_NEG = -2.3819763e38  # "large negative" chosen for fp32/bf16


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, h, pad):
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        mask = pad[:, None, :] & pad[:, :, None]  # padding queries see nothing
        probs = torch.where(mask, scores, BIG_NEG).softmax(dim=-1)
        return self.out(probs @ v)


class TinyLM(nn.Module):
    def __init__(self, vocab=40, dim=32):
        super().__init__()
        self.embed, self.attn, self.head = nn.Embedding(vocab, dim), Attention(dim), nn.Linear(dim, vocab)

    def forward(self, ids, pad):
        return self.head(self.attn(self.embed(ids), pad))


torch.manual_seed(0)
model = TinyLM()
opt, scaler = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
ids = torch.randint(0, 40, (4, 12))
pad = torch.ones(4, 12, dtype=torch.bool)
pad[:, 9:] = False  # right padding
for step in range(8):
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(ids, pad).float()
        tok_loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
        loss = (tok_loss * pad.flatten()).sum() / pad.sum()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: loss = {loss.item()} at every step (mask fill -2.38e38 is -inf in fp16, padding rows "
             f"softmax to NaN); loss scale fell to {scaler.get_scale():g}")
