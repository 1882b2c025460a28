# source: https://github.com/NVIDIA/TransformerEngine/issues/787
# reproduces: a Megatron-style reentrant checkpoint restores RNG state but not autocast: the block (nn.Linear + frozen
#   bf16 linear) runs under bf16 autocast, backward() runs after the autocast block, so the recompute has no autocast:
#   RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16
# expect: AMP708
# expect-detail: AMP708 ^block \(Sequential\): .* n11_\w+\.py:26: its forward ran under autocast to bf
# ampdoctor-args: --audit
import torch
import torch.nn.functional as F
from torch import nn


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, x):
        ctx.run_function, ctx.rng_state = run_function, torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_function(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        torch.set_rng_state(ctx.rng_state)
        with torch.enable_grad():  # no autocast here: the backward runs after the autocast block
            out = ctx.run_function(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


class FrozenBF16Linear(nn.Module):  # weights kept in bf16, like an fp8/bf16 kernel module
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("weight", (torch.randn(dim, dim) / dim**0.5).bfloat16())

    def forward(self, x):
        return x @ self.weight.t()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), FrozenBF16Linear(32))

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + CheckpointFunction.apply(self.block, h))

torch.manual_seed(0)
model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 64, (8, 16))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
