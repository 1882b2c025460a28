"""``ampdoctor._torch.sparse``: a sparse gradient's stored rows, duplicates summed without ``coalesce()``, and its
fallback through ``coalesce()`` / ``to_dense()`` when torch lacks ``_indices``/``_values``."""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor._torch import sparse


def embedding_grad() -> torch.Tensor:
    embed = nn.Embedding(20, 3, sparse=True)
    tokens = torch.tensor([5, 2, 5, 17, 5, 2])
    (embed(tokens) * torch.arange(18.0).view(6, 3)).sum().backward()
    return embed.weight.grad


def distinct(rows: torch.Tensor) -> list[list[float]]:
    """The non-zero rows, sorted: stored_rows gives the distinct rows in no particular order, then zeros."""
    return sorted(r for r in rows.tolist() if any(r))


def test_stored_rows_sum_the_duplicates_like_coalesce_and_pad_with_zeros(monkeypatch):
    g = embedding_grad()
    assert not g.is_coalesced() and sparse.row_sparse(g)
    rows = sparse.stored_rows(g)
    assert rows.shape == (6, 3)  # as many as stored: 3 distinct rows, then 3 rows of zeros
    assert distinct(rows) == distinct(g.coalesce().values()) and rows[3:].eq(0).all()
    assert torch.equal(sparse.densified(g), g.to_dense())
    monkeypatch.setattr(sparse, "_STORED", False)  # the fallback: coalesce() and to_dense()
    assert distinct(sparse.stored_rows(g)) == distinct(rows)
    assert torch.equal(sparse.densified(g), g.to_dense())


def test_a_gradient_that_stores_no_row_gives_one_row_of_zeros():
    g = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 4), (9, 4), check_invariants=True)
    assert sparse.stored_rows(g).tolist() == [[0.0] * 4]
    entries = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1.0]), (2, 2), check_invariants=True)
    assert not sparse.row_sparse(entries)  # sparse in both dimensions: single entries, not rows
