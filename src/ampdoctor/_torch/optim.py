"""Optimizer and LR-scheduler internals.

``LRScheduler._step_count`` counts ``scheduler.step()`` calls, including the one its constructor makes. Without it
the answer is None, and the caller treats every step as a real one.
"""

from __future__ import annotations

from typing import Any


def scheduler_step_count(scheduler: Any) -> int | None:
    """Return how many times ``scheduler.step()`` ran (its constructor's call is the first), None if unknown.

    >>> import torch
    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> scheduler_step_count(torch.optim.lr_scheduler.StepLR(opt, step_size=1))
    1
    """
    count = getattr(scheduler, "_step_count", None)
    return count if isinstance(count, int) else None
