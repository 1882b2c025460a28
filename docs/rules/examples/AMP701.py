"""A retrieval model trained in pure fp16 (``.half()``, no autocast) normalises its embeddings with ``F.normalize``,
whose ``eps=1e-12`` is 0 in fp16: the padding token's zero embedding divides 0 by 0, and the loss is NaN."""
# command: ampdoctor run --audit {script}
# reproduces: https://github.com/pytorch/pytorch/issues/104294 (F.normalize's eps underflows in half precision)
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
emb = nn.Embedding(32, 16, padding_idx=0).half()   # the padding row is all zeros
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
for step in range(3):
    ids = torch.randint(1, 32, (8, 4))
    ids[:, -1] = 0                                   # padded batches
    z = F.normalize(emb(ids), dim=-1)                # eps=1e-12 is 0 in fp16: 0 / 0 for the padding
    loss = (z.float() @ z.float().transpose(1, 2)).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"loss {loss.item()}")
