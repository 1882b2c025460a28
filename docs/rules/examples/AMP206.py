"""A sparse embedding (``nn.Embedding(..., sparse=True)``) trained on CUDA with a GradScaler on a torch version
whose unscale kernel has no SparseCUDA version. This needs CUDA and such a torch, so the page explains the error
text instead of running it (on CPU, current torch has the sparse kernel: the loop below runs)."""
# command: ampdoctor explain "RuntimeError: Could not run 'aten::_amp_foreach_non_finite_check_and_unscale_' with arguments from the 'SparseCUDA' backend."
import torch
from torch import nn

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Embedding(100, 16, sparse=True), nn.Linear(16, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler(device)
ids, y = torch.randint(0, 100, (32,), device=device), torch.randn(32, 1, device=device)
for step in range(3):
    with torch.autocast(device, dtype=torch.float16):
        loss = nn.functional.mse_loss(model(ids).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)  # old torch on CUDA: "Could not run ... 'SparseCUDA' backend"
    scaler.update()
