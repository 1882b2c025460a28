"""BackwardMonitor (``ampdoctor.monitor.backward``) through a watch: which backward calls had their gradients
dropped before a step used them, and which are ordinary (accumulation, a step's own closure evaluations)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampdoctor.monitor.watcher import watch


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def loop(shape: str, steps: int = 6) -> dict:
    """Train an MLP ``steps`` times in the loop ``shape``; return the watch's loss summary."""
    model, x = mlp(), torch.randn(8, 16)
    opt = (torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4) if shape == "step(closure), LBFGS" else
           torch.optim.SGD(model.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("cpu") if "scaler" in shape else None

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with watch(model, opt, scaler, every=1) as w:
        for _ in range(steps):
            if shape == "step(closure), LBFGS":   # evaluates the closure up to 4 times in one step
                opt.step(closure)
            elif shape == "accumulation":
                for _ in range(3):
                    model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            elif shape == "scaler, zero_grad() before update()":
                scaler.scale(model(x).pow(2).mean()).backward()
                scaler.step(opt)
                opt.zero_grad()
                scaler.update()
            elif shape == "a layer's zero_grad() before the step (freezing it)":
                model(x).pow(2).mean().backward()
                model[0].zero_grad()   # the first layer (the probe's) stays as it is; the others train
                opt.step()
            elif shape == "gradients moved out before the step (ZeRO)":
                model(x).pow(2).mean().backward()
                for p in model.parameters():   # an engine keeps them in its own buffers (ZeRO's partitions)
                    p.grad = None
                opt.step()
    return w.summary_data()["loss"] | {"codes": [f.code for f in w.findings()]}


@pytest.mark.parametrize("shape", ["step(closure), LBFGS", "accumulation", "scaler, zero_grad() before update()",
                                   "a layer's zero_grad() before the step (freezing it)",
                                   "gradients moved out before the step (ZeRO)"])
def test_ordinary_loops_drop_no_backward_call(shape: str) -> None:
    # LBFGS's closure evaluations (zero_grad, backward, 4 times a step) were counted as dropped: a false AMP612
    loss = loop(shape)
    assert (loss["dropped"], loss["zeroed_before_step"], loss["unstepped"]) == (0, 0, 0)
    assert "AMP612" not in loss["codes"]


def test_the_zero_grad_observers_go_with_the_watch() -> None:
    originals = (torch.optim.Optimizer.__dict__["zero_grad"], nn.Module.__dict__["zero_grad"])
    model = mlp()
    w = watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.optim.Optimizer.__dict__["zero_grad"] is not originals[0]
    w.detach()
    assert (torch.optim.Optimizer.__dict__["zero_grad"], nn.Module.__dict__["zero_grad"]) == originals
