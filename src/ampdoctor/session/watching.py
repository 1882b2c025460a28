"""Which model and optimizer a run's watch follows, and which part of the trained models that covers."""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ampdoctor.core.records import Coverage
from ampdoctor.core.training import optimizer_tensors, owns_any, unwrap_optimizer

__all__ = ["watched_size", "watch_coverage", "watched_pair"]


def watched_pair(models: Sequence[nn.Module], optimizers: Sequence[Any]) -> tuple[nn.Module, Any]:
    """Return the model the watch follows (the one with the most entries it can summarise) and the optimizer that
    trains it, as given (a framework's wrapper is kept: accelerate's skips steps itself; the watch sees through).

    >>> m = nn.Linear(2, 2); import torch; o = torch.optim.SGD(m.parameters(), lr=0.1)
    >>> watched_pair([m], [o]) == (m, o)
    True
    """
    model = max(models, key=watched_size)
    optimizer = next((o for o in optimizers if owns_any(unwrap_optimizer(o), model)), optimizers[0])
    return model, optimizer


def watched_size(model: nn.Module) -> int:
    """Return how many trainable entries of ``model`` the watch can summarise: those of a sparse embedding
    (``sparse=True``: sparse gradients) do not count, so a dense model is watched rather than a sparse one.

    >>> watched_size(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))
    10
    """
    sparse = {id(p) for m in model.modules() if getattr(m, "sparse", False) is True for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in sparse)


def watch_coverage(optimizer: Any, setup: Any, optimizers: Sequence[Any] | None = None,
                   models: Sequence[nn.Module] | None = None) -> Coverage | None:
    """Return which part of the trained models ``optimizer`` (the one a watch follows) steps, when other
    optimizers step the rest (two models, Muon next to AdamW, one optimizer per parameter); else None.
    ``optimizers`` and ``models``: the watch's stage's, when not all of ``setup``'s (a k-fold's later fold)."""
    optimizers = setup.optimizers if optimizers is None else optimizers
    trainable = {id(p) for m in (setup.models if models is None else models) for p in m.parameters()
                 if p.requires_grad}
    others = [o for o in optimizers
              if o is not optimizer and any(id(p) in trainable for p in optimizer_tensors(o))]
    if not others:
        return None
    return Coverage(setup.optimizer_label(optimizer), len(others), len(trainable),
                    sum(id(p) in trainable for p in optimizer_tensors(optimizer)))
