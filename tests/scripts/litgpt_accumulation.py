"""litgpt's full finetune loop on Lightning Fabric, with gradient accumulation; prints the weights' update as JSON.

Re-created in our own words (no code copied) from Lightning-AI/litgpt at 26857050fe3ff627cd714fe92f5838f51a3d5efa,
litgpt/finetune/full.py (last changed in 31e5fcaf8486; ``fit`` and ``main``). What it keeps: ``L.Fabric(precision=...)``
("bf16-true": the model itself in bf16, no autocast, no scaler), ``fabric.setup(model)``, AdamW over
``model.parameters()`` through ``fabric.setup_optimizers``, a linear warm-up ``LambdaLR``, and the loop: ``iter_num``
counts micro-batches, ``is_accumulating = iter_num % accum != 0``, the forward and ``fabric.backward(loss / accum)``
under ``fabric.no_backward_sync(model, enabled=is_accumulating)``, and only when not accumulating
``optimizer.step()``, ``optimizer.zero_grad()``, ``scheduler.step()``. A tiny GPT-like stack on random tokens, the
loss the cross-entropy of each token's prediction of the next.

Arguments: the Fabric precision ("bf16-true", or "32-true" for the fp32 reference, which starts from the same
bf16-rounded weights), and ``drop`` (ours, a bug): ``optimizer.zero_grad()`` after each accumulating micro-batch,
which throws its gradients away.
"""
import json
import sys

import lightning as L
import torch
from torch import nn

precision, drop = sys.argv[1], sys.argv[2:] == ["drop"]
accum, vocab = 2, 32
fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(vocab, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16),
                      nn.Linear(16, vocab))
with torch.no_grad():
    for p in model.parameters():   # both precisions start from the same values, exact in bf16
        p.copy_(p.to(torch.bfloat16))
start = [p.detach().float().clone() for p in model.parameters()]
model = fabric.setup(model)
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0))
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
g = torch.Generator().manual_seed(1)
batches = [torch.randint(0, vocab, (4, 9), generator=g) for _ in range(16)]
for iter_num, input_ids in enumerate(batches, start=1):
    is_accumulating = iter_num % accum != 0
    with fabric.no_backward_sync(model, enabled=is_accumulating):
        logits = model(input_ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), input_ids[:, 1:].reshape(-1))
        fabric.backward(loss / accum)
    if drop and is_accumulating:
        optimizer.zero_grad()
    if not is_accumulating:
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
print(json.dumps([(p.detach().float() - s).flatten().tolist() for p, s in zip(model.parameters(), start)]))
