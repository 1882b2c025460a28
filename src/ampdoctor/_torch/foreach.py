"""torch's multi-tensor kernels: norms, copies, adds and zeroing of a list of tensors in one launch per device.

``torch._foreach_norm``, ``_foreach_copy_``, ``_foreach_add_`` and ``_foreach_zero_`` are what torch's own optimizers
and ``clip_grad_norm_`` use (torch 2.13 has all four). Without one, the same work runs one tensor at a time
(``torch.linalg.vector_norm``, ``Tensor.copy_``, ``add_``, ``zero_``): the values are the same, only the launches
are more. Every function takes lists of equal length; an empty list does nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

_NORM = getattr(torch, "_foreach_norm", None)
_COPY = getattr(torch, "_foreach_copy_", None)
_ADD = getattr(torch, "_foreach_add_", None)
_ZERO = getattr(torch, "_foreach_zero_", None)


def norms(tensors: Sequence[torch.Tensor], ord: float = 2.0, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Return the ``ord``-norm of each tensor as a 0-d tensor on its device, computed in ``dtype`` if given.

    >>> [round(float(n), 3) for n in norms([torch.ones(4), torch.full((2,), -3.0)], float("inf"))]
    [1.0, 3.0]
    """
    if not tensors:
        return []
    if _NORM is not None:
        return list(_NORM(list(tensors), ord, dtype=dtype))
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]


def copy_(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy each source into its destination in place (casting to the destination's dtype).

    >>> out = [torch.zeros(2, dtype=torch.float16)]
    >>> copy_(out, [torch.ones(2)]); out[0].tolist()
    [1.0, 1.0]
    """
    if not destinations:
        return
    if _COPY is not None:
        _COPY(list(destinations), list(sources))
        return
    for destination, source in zip(destinations, sources):
        destination.copy_(source)


def add_(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Add each source into its destination in place, in the destination's dtype."""
    if not destinations:
        return
    if _ADD is not None:
        _ADD(list(destinations), list(sources))
        return
    for destination, source in zip(destinations, sources):
        destination.add_(source)


def zero_(tensors: Sequence[torch.Tensor]) -> None:
    """Fill every tensor with zeros in place."""
    if not tensors:
        return
    if _ZERO is not None:
        _ZERO(list(tensors))
        return
    for t in tensors:
        t.zero_()
