"""A half model with two Adam optimizers (body and head learning rates), resumed from a checkpoint of a pure-fp16
run, so both optimizers hold fp16 state when the training starts."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
body = torch.optim.Adam(model[0].parameters(), lr=1e-3, eps=1e-4)
head = torch.optim.Adam(model[2].parameters(), lr=1e-2, eps=1e-4)
for opt in (body, head):  # the checkpoint: one pure-fp16 step's state, loaded into fp16 params (state becomes fp16)
    for p in (q for g in opt.param_groups for q in g["params"]):
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    saved = opt.state_dict()
    opt.state.clear()
    for p in (q for g in opt.param_groups for q in g["params"]):
        p.grad = None
    opt.load_state_dict(saved)
scaler = torch.amp.GradScaler("cpu")
for step in range(5):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(body)
    scaler.step(head)
    scaler.update()
    body.zero_grad()
    head.zero_grad()
    print(f"loss {loss.item():.6f}")
states = [s for o in (body, head) for s in o.state.values()]
print("state dtypes", sorted({str(v.dtype) for s in states for k, v in s.items() if k != "step"}))
