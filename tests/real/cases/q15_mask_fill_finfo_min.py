# source: https://github.com/huggingface/lerobot/pull/710
# reproduces: nothing - the attention, the padded batch and the fp16 AMP loop of n03, with the mask fill value taken
#   from the scores' dtype (torch.finfo(scores.dtype).min): fully masked padding rows softmax to a finite uniform row.
# expect: quiet
# ampdoctor-args: --audit
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, h, pad):
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        mask = pad[:, None, :] & pad[:, :, None]
        probs = torch.where(mask, scores, torch.finfo(scores.dtype).min).softmax(dim=-1)
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
pad[:, 9:] = False
for step in range(8):
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(ids, pad).float()
        tok_loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
        loss = (tok_loss * pad.flatten()).sum() / pad.sum()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f} scale {scaler.get_scale():g}")
