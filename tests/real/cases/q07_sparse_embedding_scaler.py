# source: https://github.com/pytorch/pytorch/issues/35810 (failures.md row 38: fixed by PR #36786)
# reproduces: nothing - nn.Embedding(sparse=True) with fp16 autocast and GradScaler("cpu"): sparse grads are
#   unscaled through ._values(); no error today.
# expect: quiet
import torch
from torch import nn

torch.manual_seed(0)
emb = nn.Embedding(100, 16, sparse=True)
head = nn.Linear(16, 2)
model = nn.ModuleDict({"emb": emb, "head": head})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
ids, y = torch.randint(0, 100, (32, 6)), torch.randint(0, 2, (32,))
for step in range(15):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model["head"](model["emb"](ids).mean(1)).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f}")
