"""A pure-fp16 model scores a sequence by the product of its per-step factors: ``prod`` multiplies them in fp16 one
after the other, an intermediate product (1e-8) flushes to 0, and the score is 0 where fp32 gives 1."""
# command: ampdoctor run --audit {script}
# reproduces: products of many factors in half precision underflow (compute them as a sum of logs, or in fp32)
import torch
from torch import nn

torch.manual_seed(0)
scorer = nn.Linear(8, 4).half()
with torch.no_grad():
    scorer.weight.zero_()
    scorer.bias.copy_(torch.tensor([-9.2, -9.2, 9.2, 9.2]))   # factors exp(-9.2) ~ 1e-4, 1e-4, 1e4, 1e4
opt = torch.optim.SGD(scorer.parameters(), lr=1e-3)
for step in range(3):
    factors = torch.exp(scorer(torch.randn(16, 8, dtype=torch.float16)))
    score = factors.prod(dim=-1)                       # 1e-4 * 1e-4 = 1e-8: 0 in fp16
    loss = (score.float() - 1).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"score {score[0].item()}, loss {loss.item():.4f}")
