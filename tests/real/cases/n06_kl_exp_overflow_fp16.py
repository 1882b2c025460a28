# source: https://github.com/hcy71o/SC-CNN/issues/4
# reproduces: a VITS-style KL term against a sharp prior (log-scale ~ -6) under fp16 autocast: torch.exp(-2 * logs_p) =
#   exp(12) = 1.6e5 overflows fp16 to inf (inf * 0 = NaN where z_p == m_p), so kl_loss (~5 in fp32) is NaN at every step
#   and the GradScaler skips every step; the report's workaround is to switch fp16 off.
# expect: AMP702
# expect-detail: AMP702 aten\.exp\.default at n06_\w+\.py:16 \(forward, float16\)
# ampdoctor-args: --audit
import sys

import torch
from torch import nn


def kl_loss(z_p, logs_q, m_p, logs_p):
    kl = logs_p - logs_q - 0.5
    kl = kl + 0.5 * ((z_p - m_p) ** 2) * torch.exp(-2.0 * logs_p)
    return kl.mean()


torch.manual_seed(0)
prior, posterior = nn.Linear(16, 16), nn.Linear(16, 16)  # each predicts (mean, log-scale) of an 8-d latent
with torch.no_grad():  # resumed checkpoint: posterior matches a sharp prior
    posterior.load_state_dict(prior.state_dict())
    prior.bias[8:] = -6.0
    posterior.bias[8:] = -6.0
params = [*prior.parameters(), *posterior.parameters()]
opt, scaler = torch.optim.AdamW(params, lr=1e-4), torch.amp.GradScaler("cpu", init_scale=2.0**8)
text, audio = torch.randn(512, 16), torch.randn(512, 16)
for step in range(8):
    with torch.autocast("cpu", dtype=torch.float16):
        m_p, logs_p = prior(text).chunk(2, dim=-1)
        m_q, logs_q = posterior(text + 0.01 * audio).chunk(2, dim=-1)
        z_p = m_q + torch.randn_like(m_q) * torch.exp(logs_q)
        loss = kl_loss(z_p, logs_q, m_p, logs_p)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"step {step} kl {loss.item():.4f} scale {scaler.get_scale():g}")
if not torch.isfinite(loss):
    sys.exit(f"SYMPTOM: kl_loss = {loss.item()} at every step (exp(-2 * logs_p) overflows fp16); "
             f"loss scale fell to {scaler.get_scale():g}")
