"""A part of the watch added in this one file, with no edit to ampdoctor: the largest |gradient| of each sampled step.

python toy_part.py [STEPS]   (under ``ampdoctor run``)

Importing it registers the part (``monitor.part.register_part``) and its summary section
(``core.records.register_section``); then it trains a tiny model under fp16 autocast and a GradScaler. Its numbers
must reach every view: the console, ``--json``, the flight recorder, ``ampdoctor report`` and the HTML page.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from ampdoctor.core.records import Section, register_section
from ampdoctor.monitor.part import Reading, WatchContext, WatchPart, register_part


@dataclass(frozen=True)
class ToySection(Section):
    """The toy part's section: sampled steps looked at, and the largest unscaled |gradient| among them."""

    looked: int = 0
    largest: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"looked": self.looked, "largest_grad": self.largest}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ToySection":
        return cls(int(data.get("looked", 0)), float(data.get("largest_grad", 0.0)))


register_section("toy", ToySection)


@register_part
class ToyPart(WatchPart):
    """On each sampled step, at the read point: the largest unscaled |gradient| entry, on the device."""

    name = "toy"

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params
        self._max: torch.Tensor | None = None
        self.looked, self.largest = 0, 0.0

    @classmethod
    def create(cls, ctx: WatchContext) -> "ToyPart":
        return cls(ctx.params)

    def read_point(self, scale: torch.Tensor | None, scaled: bool) -> None:
        grads = [p.grad.detach().abs().max().float() for p in self._params if p.grad is not None]
        if grads:
            largest = torch.stack(grads).max().reshape(1)
            self._max = largest / scale.reshape(1) if scaled and scale is not None else largest

    def pending(self, partial: bool) -> dict[str, torch.Tensor] | None:
        values, self._max = self._max, None
        return None if values is None else {"max": values}

    def consume(self, host: dict[str, list[float]], reading: Reading) -> dict[str, Any]:
        self.looked += 1
        self.largest = max(self.largest, host["max"][0])
        return {"toy": {"max_grad": host["max"][0]}}

    def sections(self) -> dict[str, Any]:
        return {"toy": ToySection(self.looked, self.largest)}

    def detach(self) -> None:
        self._params = []


if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    print("done")
