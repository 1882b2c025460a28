# source: https://github.com/huggingface/transformers/issues/27212 (failures.md row 16; also afiaka87/glide-finetune #5)
# reproduces: pure fp16 training (model.half(), no autocast, no scaler) with AdamW's default eps=1e-8, which is 0
#   in fp16: embedding rows that get no gradient become 0/0 = NaN after the first step, and the loss turns NaN as
#   soon as a batch uses those tokens.
# expect: AMP104 AMP103
# fix: finishes
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(4 * 32, 64)).half()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = [torch.randint(0, 32, (16, 4)), torch.randint(32, 64, (16, 4))]  # second half of the vocab comes later
for step in range(6):
    ids = batches[step % 2] if step else batches[0]
    loss = nn.functional.cross_entropy(model(ids).float(), ids[:, 0])
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
    if not torch.isfinite(loss):
        sys.exit(f"SYMPTOM: loss is {loss.item()} at step {step}")
