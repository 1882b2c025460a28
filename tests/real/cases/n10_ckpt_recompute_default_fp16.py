# source: https://github.com/facebookresearch/fairscale/issues/1199
# reproduces: a hand-written reentrant checkpoint (like fairscale's) recomputes under autocast with the default dtype
#   (torch.cuda.amp.autocast() -> fp16), not the forward's bf16: forward and loss are finite, the recompute of the
#   frozen MLP (activations ~1e5) overflows fp16, the step-0 gradients are NaN, then the loss.
# expect: AMP708
# expect-detail: AMP708 ^mlp \(Sequential\): mlp \(Sequential\) at n10_\w+\.py:27: its forward ran under
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from torch import nn


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, x):
        ctx.run_function, ctx.had_autocast = run_function, torch.is_autocast_enabled("cpu")
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_function(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=ctx.had_autocast):
            out = ctx.run_function(x)  # float16: the "default" autocast dtype, not the forward's bfloat16
        torch.autograd.backward(out, grad)
        return None, x.grad


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))

    def forward(self, ids):
        return self.head((h := self.embed(ids)) + CheckpointFunction.apply(self.mlp, h))

torch.manual_seed(0)
model = Model()
with torch.no_grad():  # frozen bf16-pretrained MLP: hidden activations far beyond fp16's 65504
    model.mlp[0].weight.mul_(100.0)
    model.mlp[2].weight.mul_(1000.0)
    model.mlp[4].weight.mul_(1e-5)
model.mlp.requires_grad_(False)  # the embeddings and the head are trained
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.randint(0, 64, (8, 16))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
    opt.zero_grad()
    loss.backward()
    grad_finite = bool(model.embed.weight.grad.isfinite().all())
    opt.step()
    print(f"step {step} loss {loss.item():.4f} embedding grad finite: {grad_finite}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: loss = {loss.item()}: the recompute ran in float16, its gradients NaN from step 0")
