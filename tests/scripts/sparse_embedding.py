"""A sparse embedding stepped by SparseAdam next to AdamW for the dense head (two models, two optimizers), fp16
autocast and one GradScaler."""
import torch
from torch import nn

torch.manual_seed(0)
emb = nn.Embedding(1000, 32, sparse=True)
head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt_sparse = torch.optim.SparseAdam(list(emb.parameters()), lr=1e-3)
opt_dense = torch.optim.AdamW(head.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(12):
    idx, y = torch.randint(0, 1000, (16,)), torch.randn(16, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(head(emb(idx)).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt_sparse)
    scaler.step(opt_dense)
    scaler.update()
    opt_sparse.zero_grad()
    opt_dense.zero_grad()
print("done", loss.item())
