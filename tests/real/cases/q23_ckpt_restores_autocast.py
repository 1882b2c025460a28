# source: https://github.com/NVIDIA/TransformerEngine/issues/787
# reproduces: nothing - the block with a frozen bf16 linear and the bf16 autocast loop of n11 (backward after the
#   autocast region), checkpointed with torch.utils.checkpoint.checkpoint(use_reentrant=False), which recomputes
#   under the autocast state recorded in the forward.
# expect: quiet
# ampdoctor-args: --audit
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class FrozenBF16Linear(nn.Module):  # weights kept in bf16, like an fp8/bf16 kernel module
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("weight", (torch.randn(dim, dim) / dim**0.5).bfloat16())

    def forward(self, x):
        return x @ self.weight.t()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), FrozenBF16Linear(32))

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + checkpoint(self.block, h, use_reentrant=False))


torch.manual_seed(0)
model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 64, (8, 16))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f}")
