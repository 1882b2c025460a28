# source: https://github.com/linkedin/Liger-Kernel/pull/1239
# reproduces: nothing - the Liger-style fused linear + cross-entropy and bf16 autocast loop of n14, with the lm-head
#   gradient computed by a plain (autocast) matmul in bf16 and accumulated into the fp32 buffer with .float().
# expect: quiet
# ampdoctor-args: --audit
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
            partial = g.t() @ h  # autocast: bf16 GEMM, accumulated in fp32 below
            grad_weight += partial.float()
            FusedLinearCrossEntropy.gemm_dtypes.add(partial.dtype)
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
    assert torch.isfinite(loss)
assert FusedLinearCrossEntropy.gemm_dtypes == {torch.bfloat16}
print(f"final loss {loss.item():.4f}")
