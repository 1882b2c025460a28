# source: https://github.com/hcy71o/SC-CNN/issues/4
# reproduces: nothing - the prior/posterior heads, the sharp prior and the fp16 AMP loop of n06, with the KL term
#   computed on fp32 inputs (exp(12) = 1.6e5 is finite in fp32).
# expect: quiet
# ampdoctor-args: --audit
import torch
from torch import nn


def kl_loss(z_p, logs_q, m_p, logs_p):
    z_p, logs_q, m_p, logs_p = z_p.float(), logs_q.float(), m_p.float(), logs_p.float()
    kl = logs_p - logs_q - 0.5
    kl = kl + 0.5 * ((z_p - m_p) ** 2) * torch.exp(-2.0 * logs_p)
    return kl.mean()


torch.manual_seed(0)
prior, posterior = nn.Linear(16, 16), nn.Linear(16, 16)
with torch.no_grad():
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
        z_p = m_q.float() + torch.randn_like(m_q, dtype=torch.float32) * torch.exp(logs_q.float())
        loss = kl_loss(z_p, logs_q, m_p, logs_p)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)
print(f"final kl {loss.item():.4f} scale {scaler.get_scale():g}")
