"""A hand-written activation checkpoint (as older fairscale and Megatron-LM wrote theirs) saves the input but not the
autocast state: the forward ran under bf16 autocast, the recompute in ``backward()`` runs in fp32, so the gradients
belong to other activations than the forward used."""
# command: ampdoctor run --audit {script}
# reproduces: https://github.com/pytorch/pytorch/issues/37730 (checkpoint recompute must restore autocast state)
import torch
from torch import nn


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, x):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.block(x)                    # recomputed under whatever autocast is on now
        torch.autograd.backward(y, grad)
        return None, x.grad


torch.manual_seed(0)
block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
head = nn.Linear(32, 4)
opt = torch.optim.AdamW([*block.parameters(), *head.parameters()], lr=1e-3)
for step in range(3):
    x = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head(Checkpoint.apply(block, x)).float().pow(2).mean()
    loss.backward()                             # outside autocast: the recompute runs in fp32
    opt.step()
    opt.zero_grad()
print(f"loss {loss.item():.4f}")
