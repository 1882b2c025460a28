"""An accelerate loop on CPU: prepare, accelerator.autocast, accelerator.backward, accelerator.clip_grad_norm_.

    python accelerate_loop.py OUT [bf16|no] [STEPS]

saves ``{"state", "losses"}`` to OUT. ``train(mixed_precision, steps, attach)`` is what the tests call in-process;
``attach(model, opt, scaler)`` gets the prepared model, the prepared (wrapped) optimizer and accelerator.scaler.
"""
import contextlib
import sys

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed
from torch import nn


def keep(*objects) -> None:
    sink = sys.modules.get("harm_sink")
    if sink is not None:
        sink.keep(*objects)


def train(mixed_precision: str = "bf16", steps: int = 10, attach=None):
    # accelerate keeps one process-wide state; a second Accelerator with another precision would be refused
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    set_seed(0)
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    keep(model, opt, accelerator)
    losses = []
    with (attach(model, opt, accelerator.scaler) if attach else contextlib.nullcontext()):
        while len(losses) < steps:
            for x, y in loader:
                with accelerator.autocast():
                    loss = nn.functional.mse_loss(model(x).float(), y + x[:, :1] * 2)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if len(losses) == steps:
                    break
    return accelerator.unwrap_model(model), opt, accelerator, losses


if __name__ == "__main__":
    out = sys.argv[1]
    precision = sys.argv[2] if len(sys.argv) > 2 else "bf16"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    model, _, _, losses = train(precision, steps)
    torch.save({"state": model.state_dict(), "losses": losses}, out)
