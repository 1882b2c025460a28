"""The rows of a sparse COO gradient (``nn.Embedding(sparse=True)``), read without a host sync.

An uncoalesced COO tensor can list a row twice (a token twice in the batch), and its public ``indices()`` and
``values()`` refuse it until ``coalesce()``, which on CUDA reads the number of distinct rows on the host (a sync).
``Tensor._indices()`` and ``_values()`` read the stored lists as they are; the duplicates are then summed on the device
into a buffer of the stored length. Without them the rows come from ``coalesce()`` (the same values, with a host sync
per call on CUDA), and a small gradient is made dense by ``to_dense()``.
"""

from __future__ import annotations

import torch

_STORED = hasattr(torch.Tensor, "_indices") and hasattr(torch.Tensor, "_values")  # the lists as stored


def row_sparse(g: torch.Tensor) -> bool:
    """Return whether ``g`` is a COO tensor sparse in its first dimension only: whole rows are stored or absent.

    >>> e = torch.nn.Embedding(10, 3, sparse=True)
    >>> e(torch.tensor([1, 1])).sum().backward()
    >>> row_sparse(e.weight.grad), row_sparse(torch.zeros(2))
    (True, False)
    """
    return g.layout == torch.sparse_coo and g.sparse_dim() == 1 and g.dense_dim() >= 1


def stored_rows(g: torch.Tensor) -> torch.Tensor:
    """Return the rows a row-sparse ``g`` stores, as a dense ``[stored, *g.shape[1:]]`` tensor: the distinct rows,
    duplicates summed (in no particular order), then rows of zeros (as many as the duplicates); one row of zeros when
    ``g`` stores none. A row whose entries are all 0 is not told apart from an absent one.

    >>> e = torch.nn.Embedding(10, 2, sparse=True)
    >>> e(torch.tensor([4, 1, 4])).sum().backward()
    >>> sorted(stored_rows(e.weight.grad).tolist())
    [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    """
    if not _STORED or g.is_coalesced():
        values = g.coalesce().values()
        return values if values.shape[0] else values.new_zeros(1, *values.shape[1:])
    rows, values = g._indices()[0], g._values()
    if not rows.numel():
        return values.new_zeros(1, *values.shape[1:])
    ordered, order = rows.sort()
    first = torch.ones_like(ordered, dtype=torch.bool)  # the first listing of each distinct row, in sorted order
    first[1:] = ordered[1:] != ordered[:-1]
    slot = first.cumsum(0).sub_(1)  # its distinct row's slot, 0 .. distinct - 1
    return torch.zeros_like(values).index_add_(0, torch.empty_like(slot).scatter_(0, order, slot), values)


def densified(g: torch.Tensor) -> torch.Tensor:
    """Return a row-sparse ``g`` as a dense tensor, duplicates summed, with no host sync (for small ones: it
    allocates the whole tensor).

    >>> e = torch.nn.Embedding(3, 1, sparse=True)
    >>> e(torch.tensor([2, 0, 2])).sum().backward()
    >>> densified(e.weight.grad).tolist()
    [[1.0], [0.0], [2.0]]
    """
    if not _STORED:
        return g.to_dense()
    values = g._values()
    return values.new_zeros(g.shape).index_add_(0, g._indices()[0], values)
