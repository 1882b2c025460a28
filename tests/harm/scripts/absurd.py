"""Training loops on setups ampdoctor's authors did not have in mind; each must train as it does without it.

    python absurd.py OUT CASE [STEPS]

CASE is one of CASES. Saves ``{"state": model.state_dict(), "losses": [...]}`` to OUT. Tests call
``train(case, steps, attach)`` in-process too; ``attach(model, optimizer, scaler)`` returns a context manager.
"""
import contextlib
import sys

import torch
from torch import nn


def keep(*objects) -> None:
    sink = sys.modules.get("harm_sink")
    if sink is not None:
        sink.keep(*objects)


class Tied(nn.Module):
    """A language-model head tied to the embedding (GPT-2, T5): one Parameter, two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, i):
        return self.out(torch.relu(self.mix(self.emb(i))))


class ZeroElement(nn.Module):
    """Parameters with no entries (a pruned head, an empty LoRA rank) next to normal ones."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.empty = nn.Parameter(torch.zeros(0))
        self.empty2d = nn.Parameter(torch.zeros(0, 3))
        self.frozen_empty = nn.Parameter(torch.zeros(0), requires_grad=False)

    def forward(self, x):
        return self.lin(x) + self.empty.sum() + self.empty2d.sum()


class Scalar(nn.Module):
    """A module whose output is its own Parameter (a learned log-std, a temperature): the output is a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.zeros(1))

    def forward(self):
        return self.value


class WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.log_scale = Scalar()

    def forward(self, x):
        return self.lin(x) * self.log_scale().exp()


CASES = ("sparse", "complex", "zero-element", "tied", "two-optimizers", "meta-init", "param-output", "meta")


def build(case):
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    if case == "sparse":  # sparse embedding gradients, SGD, GradScaler
        model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Linear(8, 1))
        return model, [torch.optim.SGD(model.parameters(), lr=0.1)], scaler
    if case == "complex":  # complex64 weights (no GradScaler: torch cannot unscale complex gradients)
        model = nn.Linear(4, 4).to(torch.complex64)
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], None
    if case == "zero-element":
        model = ZeroElement()
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)], scaler
    if case == "tied":
        model = Tied()
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], scaler
    if case == "two-optimizers":  # the head is in both optimizers
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        return model, [torch.optim.SGD(model.parameters(), lr=0.05),
                       torch.optim.AdamW(model[2].parameters(), lr=1e-3)], scaler
    if case == "meta-init":  # deferred init: built on meta, materialized with to_empty, then initialized
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        model = materialize(model)
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], scaler
    if case == "meta":  # never materialized: forward, backward and step all run on the meta device
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], None
    if case == "param-output":
        model = WithScalar()
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], scaler
    raise SystemExit(f"unknown case {case!r}; one of {CASES}")


def materialize(model):
    """Give a model built on the meta device real CPU storage, then initialize each layer as its constructor would."""
    model = model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return model


def batch(case):
    if case in ("sparse", "tied"):
        return torch.randint(0, 20, (16,))
    if case == "complex":
        return torch.randn(8, 4, dtype=torch.complex64)
    if case == "meta":
        return torch.randn(16, 4, device="meta")
    return torch.randn(16, 4)


def loss_of(case, model, x):
    if case == "complex":
        return (model(x) - x).abs().pow(2).mean()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    if case == "tied":
        return nn.functional.cross_entropy(out.float(), x)
    return out.float().pow(2).mean()


def train(case, steps=6, attach=None):
    model, opts, scaler = build(case)
    keep(model, *opts, scaler)
    losses = []
    with (attach(model, opts[0], scaler) if attach else contextlib.nullcontext()):
        for _ in range(steps):
            loss = loss_of(case, model, batch(case))
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                for opt in opts:
                    opt.step()
            else:
                scaler.scale(loss).backward()
                for opt in opts:
                    scaler.step(opt)
                scaler.update()
            losses.append(float("nan") if loss.is_meta else loss.item())
    return model, opts, scaler, losses


if __name__ == "__main__":
    out, case = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    model, _, _, losses = train(case, steps)
    torch.save({"state": model.state_dict(), "losses": losses}, out)
