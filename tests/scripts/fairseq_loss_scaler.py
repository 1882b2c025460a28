"""fairseq's ``--fp16`` training, re-created for the tests in our own words (no fairseq code is copied, and fairseq
is not imported: it does not install here).

What it re-creates, from facebookresearch/fairseq at commit 3d262bb25690e4eb2e7d3c1309b1e9c406ca4b99:

* ``fairseq/optim/dynamic_loss_scaler.py``: ``DynamicLossScaler`` with the same class name, attributes
  (``loss_scale``, ``scale_factor``, ``scale_window``, ``tolerance``, ``threshold``, ``min_loss_scale``) and
  behaviour: ``check_overflow(grad_norm)`` lowers the scale and raises ``OverflowError("setting loss scale to: ...")``
  on an inf/NaN norm, and raises ``FloatingPointError("Minimum loss scale reached (...)...")`` once the scale would
  fall to ``min_loss_scale`` (with the scale put back as it was); ``update()`` grows it after ``scale_window`` clean
  iterations.
* ``fairseq/optim/fp16_optimizer.py`` (``FP16Optimizer``): an fp16 model, fp32 master copies that a torch optimizer
  steps, the loss multiplied by the scale, the norm of the unscaled fp32 gradients checked before the step, then the
  step, ``scaler.update()`` and the fp32 weights copied back into the fp16 model.
* ``fairseq/trainer.py`` (``train_step``): an ``OverflowError`` is caught, the gradients are zeroed and the step is
  skipped; a ``FloatingPointError`` ends the run. ``--fp16-init-scale`` defaults to 2**7 (``dataclass/configs.py``).

``exploding``: ``--lr 3.0``: the weights blow up, the fp16 forward overflows on every step, every step is skipped and
the scale falls from 128 until the scaler stops the run. ``healthy``: ``--lr 1e-3``: every step trains.
"""

import sys

import torch
from torch import nn


class DynamicLossScaler:
    """fairseq's dynamic loss scaler (see the module docstring): its names and its two exceptions."""

    def __init__(self, init_scale=2.0**15, scale_factor=2.0, scale_window=2000, tolerance=0.0, threshold=None,
                 min_loss_scale=1e-4):
        self.loss_scale = init_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.tolerance = tolerance
        self.threshold = threshold
        self.min_loss_scale = min_loss_scale
        self._iter = 0
        self._last_overflow_iter = -1
        self._last_rescale_iter = -1
        self._overflows_since_rescale = 0

    def scale(self, outputs):
        return outputs * self.loss_scale

    def update(self):
        clean = self._iter - self._last_overflow_iter
        if clean % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
        self._iter += 1

    def check_overflow(self, grad_norm):
        if grad_norm == float("inf") or grad_norm != grad_norm:
            before = self.loss_scale
            self._last_overflow_iter = self._iter
            self._overflows_since_rescale += 1
            share = self._overflows_since_rescale / float(self._iter - self._last_rescale_iter)
            if share >= self.tolerance:
                self.loss_scale /= self.scale_factor
                if self.threshold is not None:
                    self.loss_scale = max(self.loss_scale, self.threshold)
                self._last_rescale_iter = self._iter
                self._overflows_since_rescale = 0
            if self.loss_scale <= self.min_loss_scale:
                self.loss_scale = before   # stop the run at the last scale tried
                raise FloatingPointError(
                    f"Minimum loss scale reached ({self.min_loss_scale}). Your loss is probably exploding. Try "
                    "lowering the learning rate, using gradient clipping or increasing the batch size.")
            self._iter += 1
            raise OverflowError("setting loss scale to: " + str(self.loss_scale))


def build(mode: str = "exploding") -> tuple[nn.Module, list[torch.Tensor], torch.optim.Optimizer, DynamicLossScaler]:
    """Return the fp16 model, its fp32 master copies, the optimizer over them and the scaler (``--fp16-init-scale``
    2**7); ``exploding``: ``--lr 3.0``, else ``--lr 1e-3``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).half()
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.Adam(master, lr=3.0 if mode == "exploding" else 1e-3)
    return model, master, opt, DynamicLossScaler(init_scale=2.0**7, scale_window=1000)


def train_step(model: nn.Module, master: list[torch.Tensor], opt: torch.optim.Optimizer, scaler: DynamicLossScaler,
               x: torch.Tensor) -> bool:
    """One iteration of FP16Optimizer under fairseq's trainer; return whether the optimizer stepped."""
    loss = (model(x).float() - x[:, :1].float()).pow(2).mean()
    for p in model.parameters():
        p.grad = None
    scaler.scale(loss).backward()
    for p, m in zip(model.parameters(), master):
        m.grad = p.grad.float() / scaler.loss_scale
    grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in master]))
    try:
        scaler.check_overflow(float(grad_norm))
    except OverflowError:
        for m in master:   # the trainer zeroes the gradients and skips the step
            m.grad = None
        return False
    opt.step()
    scaler.update()
    with torch.no_grad():
        for p, m in zip(model.parameters(), master):
            p.copy_(m)
    return True


def train(mode: str = "exploding", steps: int = 40) -> DynamicLossScaler:
    """Train as fairseq's FP16Optimizer does, ``steps`` iterations (``exploding`` stops earlier); return the scaler."""
    model, master, opt, scaler = build(mode)
    data = torch.randn(steps, 32, 16).half()
    for x in data:
        train_step(model, master, opt, scaler, x)
    return scaler


if __name__ == "__main__":
    scaler = train(sys.argv[1] if len(sys.argv) > 1 else "exploding")
    print(f"loss scale {scaler.loss_scale:g}")
