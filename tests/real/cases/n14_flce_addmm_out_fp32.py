# source: https://github.com/linkedin/Liger-Kernel/pull/1239
# reproduces: a Liger-style fused linear + cross-entropy (gradients computed chunk by chunk in the forward) under bf16
#   autocast accumulates the lm-head gradient with torch.addmm(..., out=grad_weight): out= calls are not autocast, so
#   the largest GEMM of the step runs in fp32, the slow fallback flagged in the review (no error).
# expect: AMP706
# expect-detail: AMP706 aten\.addmm\.out at n14_\w+\.py:31 computes in float32 inside autocast to bfloat16
# ampdoctor-args: --audit
import sys

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinearCrossEntropy(torch.autograd.Function):
    gemm_dtypes = set()

    @staticmethod
    def forward(ctx, hidden, weight, target, chunk=32):
        n = hidden.shape[0]
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)  # fp32 accumulator
        loss = torch.zeros((), dtype=torch.float32)
        for s in range(0, n, chunk):
            h, t = hidden[s:s + chunk], target[s:s + chunk]
            logits = (h @ weight.t()).float()  # autocast: bf16 GEMM
            loss += F.cross_entropy(logits, t, reduction="sum")
            g = logits.softmax(-1)
            g[torch.arange(len(t)), t] -= 1.0
            g /= n
            grad_hidden[s:s + chunk] = g @ weight  # autocast: bf16 GEMM
            torch.addmm(grad_weight, g.t(), h.to(grad_weight.dtype), out=grad_weight)  # out=: fp32 GEMM
            FusedLinearCrossEntropy.gemm_dtypes.add(grad_weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None


torch.manual_seed(0)
body, lm_head = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 64), nn.GELU()), nn.Linear(64, 512, bias=False)
opt = torch.optim.AdamW([*body.parameters(), *lm_head.parameters()], lr=1e-3)
ids = torch.randint(0, 512, (128,))
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = FusedLinearCrossEntropy.apply(body(ids), lm_head.weight, ids)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
if torch.float32 in FusedLinearCrossEntropy.gemm_dtypes:
    sys.exit("SYMPTOM: the lm-head weight-gradient GEMM (512 x 64, accumulated with addmm(..., out=)) ran in float32 "
             "inside the bf16 autocast region")
