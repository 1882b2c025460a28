"""Pure fp16 training (``model.half()``, no autocast, no GradScaler) with AdamW's default ``eps=1e-8``, which is 0
in fp16: embedding rows that got no gradient yet are updated by 0 / (0 + 0) = NaN on the first step."""
# reproduces: https://github.com/huggingface/transformers/issues/27212
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(4 * 32, 64)).half()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # eps=1e-8 rounds to 0 in fp16 (smallest: 6e-8)
batches = [torch.randint(0, 32, (16, 4)), torch.randint(32, 64, (16, 4))]  # tokens 32..63 come later
for step in range(6):
    ids = batches[step % 2]
    loss = nn.functional.cross_entropy(model(ids).float(), ids[:, 0])
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
