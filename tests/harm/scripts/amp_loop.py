"""The reference fp16-autocast + GradScaler("cpu") loop (nanoGPT style), with dropout, BatchNorm, clipping, an LR
scheduler and one step whose activations overflow fp16 (the scaler skips it).

    python amp_loop.py OUT [foreach|fused|bf16-weights] [STEPS]

saves ``{"state": model.state_dict(), "losses": [loss.item(), ...]}`` to OUT with torch.save. Tests load this
file with ``runpy.run_path(path)`` and call ``train(kind, steps, attach)``, where ``attach(model, opt, scaler)``
returns a context manager wrapping the loop (``ampdoctor.watch``).
"""
import contextlib
import sys

import torch
from torch import nn

OVERFLOW_STEP = 5  # an input 1e6x too large: fp16 activations overflow, GradScaler skips the step


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Dropout(0.25),
                                  nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build(kind: str = "foreach"):
    torch.manual_seed(0)
    model = Net()
    if kind == "bf16-weights":  # pure bf16 weights, no autocast, no scaler: lost updates are watched
        model = model.to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        return model, opt, None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01,
                            **({"fused": True} if kind == "fused" else {"foreach": True}))
    return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)


def keep(*objects) -> None:
    """Hand the training objects to a test that installed a ``harm_sink`` module (nothing otherwise)."""
    sink = sys.modules.get("harm_sink")
    if sink is not None:
        sink.keep(*objects)


def train(kind: str = "foreach", steps: int = 12, attach=None):
    """Train and return ``(model, opt, scaler, losses)``; the global RNG drives data and dropout."""
    model, opt, scaler = build(kind)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    keep(model, opt, scaler, sched)
    losses = []
    with (attach(model, opt, scaler) if attach else contextlib.nullcontext()):
        for step in range(steps):
            x = torch.randn(64, 16)
            y = x[:, :1] * 3.0 + torch.randn(64, 1) * 0.1
            if kind == "bf16-weights":
                loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            else:
                if step == OVERFLOW_STEP:
                    x = x * 1e6
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
            sched.step()
            losses.append(loss.item())
    return model, opt, scaler, losses


if __name__ == "__main__":
    out = sys.argv[1]
    kind = sys.argv[2] if len(sys.argv) > 2 else "foreach"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    model, _, _, losses = train(kind, steps)
    torch.save({"state": model.state_dict(), "losses": losses}, out)
