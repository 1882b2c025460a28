# source: https://github.com/facebookresearch/fairscale/issues/1199
# reproduces: nothing - the block with bf16-range activations and the bf16 autocast loop of n10, checkpointed with
#   torch.utils.checkpoint.checkpoint(use_reentrant=False), which recomputes under the forward's autocast dtype.
# expect: quiet
# ampdoctor-args: --audit
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))

    def forward(self, ids):
        return self.head((h := self.embed(ids)) + checkpoint(self.mlp, h, use_reentrant=False))


torch.manual_seed(0)
model = Model()
with torch.no_grad():  # frozen bf16-pretrained MLP: hidden activations far beyond fp16's 65504
    model.mlp[0].weight.mul_(100.0)
    model.mlp[2].weight.mul_(1000.0)
    model.mlp[4].weight.mul_(1e-5)
model.mlp.requires_grad_(False)  # the embeddings and the head are trained
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.randint(0, 64, (8, 16))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
    opt.zero_grad()
    loss.backward()
    assert model.embed.weight.grad.isfinite().all()
    opt.step()
assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f}")
