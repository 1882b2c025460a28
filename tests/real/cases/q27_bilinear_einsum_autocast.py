# source: https://github.com/NVIDIA/apex/issues/302
# reproduces: nothing - the relation classifier and bf16 autocast loop of n15, with the bilinear form written as an
#   einsum (a batched matmul that autocast runs in bf16) on the same weight and bias.
# expect: quiet
# ampdoctor-args: --audit
import torch
import torch.nn.functional as F
from torch import nn


class RelationScorer(nn.Module):
    def __init__(self, n_entities=200, dim=64, n_relations=8):
        super().__init__()
        self.entities = nn.Embedding(n_entities, dim)
        self.bilinear = nn.Bilinear(dim, dim, 32)
        self.classifier = nn.Sequential(nn.GELU(), nn.Linear(32, n_relations))

    def pair(self, head, tail):
        a, b = self.entities(head), self.entities(tail)
        return torch.einsum("bi,oij,bj->bo", a, self.bilinear.weight, b) + self.bilinear.bias

    def forward(self, head, tail):
        return self.classifier(self.pair(head, tail))


torch.manual_seed(0)
model = RelationScorer()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
head, tail, rel = torch.randint(0, 200, (256,)), torch.randint(0, 200, (256,)), torch.randint(0, 8, (256,))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pair = model.pair(head, tail)
        loss = F.cross_entropy(model.classifier(pair).float(), rel)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
print(f"final loss {loss.item():.4f}")
