# source: https://github.com/pytorch/ao/pull/1124 (failures.md row 39, group J; also pytorch #120376)
# reproduces: "full bf16" training, weights in bf16 with no fp32 master copy: AdamW steps of ~lr=1e-3 are below
#   half an ulp of a LayerNorm gain of 1.0 (2**-8), so the gains never move, with no error.
# expect: AMP103 AMP607
# fix: finishes
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 1)).to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
x = torch.randn(256, 16, dtype=torch.bfloat16)
y = (x[:, :1].float() * 2.0 - x[:, 1:2].float())
gain = model[1].weight.detach().clone()
for step in range(30):
    loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"final loss {loss.item():.4f}")
if torch.equal(model[1].weight.detach(), gain):
    sys.exit("SYMPTOM: LayerNorm gain identical after 30 AdamW steps: bf16 updates rounded away")
