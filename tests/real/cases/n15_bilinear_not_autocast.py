# source: https://github.com/NVIDIA/apex/issues/302
# reproduces: a relation classifier whose nn.Bilinear scores pairs of entity embeddings inside a bf16 autocast region:
#   bilinear is on no autocast list, so with the fp32 embeddings it silently runs its matmuls in fp32 (with the bf16
#   outputs of a Linear it would raise instead, as in the apex report); the rest of the model runs in bf16.
# expect: AMP706
# expect-detail: AMP706 aten\._trilinear\.default at n15_\w+\.py:\d+ computes in float32 inside autocast
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from torch import nn


class RelationScorer(nn.Module):
    def __init__(self, n_entities=200, dim=64, n_relations=8):
        super().__init__()
        self.entities = nn.Embedding(n_entities, dim)
        self.bilinear = nn.Bilinear(dim, dim, 32)
        self.classifier = nn.Sequential(nn.GELU(), nn.Linear(32, n_relations))

    def forward(self, head, tail):
        return self.classifier(self.bilinear(self.entities(head), self.entities(tail)))


torch.manual_seed(0)
model = RelationScorer()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
head, tail, rel = torch.randint(0, 200, (256,)), torch.randint(0, 200, (256,)), torch.randint(0, 8, (256,))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pair = model.bilinear(model.entities(head), model.entities(tail))
        loss = F.cross_entropy(model.classifier(pair).float(), rel)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f} bilinear output {pair.dtype}")
if pair.dtype == torch.float32:
    sys.exit("SYMPTOM: nn.Bilinear ran in float32 inside the bf16 autocast region (the classifier ran in bf16)")
