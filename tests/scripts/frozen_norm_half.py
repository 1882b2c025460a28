"""model.half() with a frozen LayerNorm between a trainable embedding and head: --fix must leave a forward that runs."""
import torch
from torch import nn

torch.manual_seed(0)
class M(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(50, 16)
        s.norm = nn.LayerNorm(16)
        s.head = nn.Linear(16, 1)
    def forward(s, x): return s.head(s.norm(s.emb(x))).squeeze(-1)
m = M().half()
m.norm.requires_grad_(False)
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(5):
    x, y = torch.randint(0, 50, (4, 7)), torch.randn(4, 7)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(m(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
print("done", loss.item())
