"""torchtune's optimizer in backward (recipes/full_finetune_single_device.py, ``optimizer_in_bwd=True``): one
AdamW per parameter, stepped and cleared in a post-accumulate-grad hook; the model in bf16, no GradScaler."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(torch.bfloat16)
optim_dict = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}


def step_hook(p):
    optim_dict[p].step()
    optim_dict[p].zero_grad()


for p in model.parameters():
    p.register_post_accumulate_grad_hook(step_hook)
for step in range(12):
    x, y = torch.randn(8, 16, dtype=torch.bfloat16), torch.randint(0, 4, (8,))
    loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
print(f"loss {loss.item():.4f}")
