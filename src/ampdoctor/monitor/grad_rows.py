"""Pick the examined entries of a large gradient among the rows that carry gradient, on the device, with no host sync.

An embedding's gradient is dense but non-zero only in the rows of the batch's distinct tokens: 16 of them touch 16 of
the 49408 rows of open_clip's 49408 x 512 token embedding, and a uniform sample of 4096 of its entries holds about
one entry of theirs (4096 x 16 / 49408), often none, so their underflow goes unmeasured. Any weight whose rows only
some inputs reach does the same. So ``GradStats`` examines a gradient of more than ``sample`` entries with at least
two dimensions by rows: viewed as ``[rows, cols]`` (rows: its first dimension), its per-row L2 norms (one reading
pass; on CPU it replaces the whole tensor's dot, whose L2 is theirs, and costs about 20% more than the dot on the
matrices of bench/overhead.py) say which rows are touched (a non-zero or non-finite norm), and the sample is drawn
among those rows only.

The draws are fixed per parameter (``row_draws``): per examined entry a ``u`` uniform in [0, 1) and a column. The
entry is the touched row number ``floor(u * T)`` of the ``T`` touched rows, at that column: the touched rows are
listed in order at the head of a buffer (a running count of touched rows says each one's place, and a scatter puts
it there), and the entry's row is read from it. ``T`` stays on the device and nothing on the host depends on it. ``u``
is ``(row + v) / rows`` for the row of a ``sample_index`` draw and an independent uniform ``v``: uniform in [0, 1),
so the touched rows are sampled uniformly, and when every row is touched it picks that row back, so a dense gradient
examines exactly the entries of its uniform sample (its statistics are unchanged). The draws of a group's members
are picked together, in about 35 ATen ops (views included) whatever their number.

The examined entries stand for the ``T * cols`` entries of the touched rows (``covered``): the format shares are the
touched rows', and the counts that ``GradStats`` scales up to the whole parameter (zeros, negligible, non-finite) are
scaled by ``covered / examined``, with the untouched rows' entries added to the zeros.

A row whose entries are all below 2**-75 in stored units has a float32 norm of 0 (every square flushes to 0) and
counts as untouched, its entries as zeros. Next to a tensor abs-max of 2**-50 or more they are below ``FLOOR``
(2**-24) times it, negligible anyway; a tensor whose abs-max is below 2**-50 has every row counted as touched.

A sparse COO gradient (``nn.Embedding(sparse=True)``) is examined the same way over the rows it stores
(``ampdoctor._torch.sparse.stored_rows``, duplicates summed): the same draws, with ``T`` among the stored rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Rows", "row_draws", "rows_of", "pick_rows", "SMALL", "EDGE"]

SMALL = 2.0**-50  # below this abs-max every row counts as touched: see the module docstring
EDGE = 2.0**-20  # v stays this far inside [0, 1): floor(u * rows) is the drawn row despite float64 rounding


@dataclass
class Rows:
    """Where the examined entries of a group's members examined by rows lie: their rows concatenated, member by
    member (built once per group; a sparse member gets its own, its rows set at each call by ``stored``). Every
    member has the same number ``K`` of examined entries (``GradStats.sample``)."""

    members: tuple[int, ...]  # the members (positions in the group), in concatenation order
    index: torch.Tensor  # long [M]: the same, on the device
    u: torch.Tensor  # float64 [M, K]: the fixed draw in [0, 1) of every examined entry
    shift: torch.Tensor  # long [M, K]: its drawn column minus the first row of its member times its columns
    cols: torch.Tensor  # long [M, 1]: the columns of each member
    width: torch.Tensor  # float64 [M]: the same
    bounds: torch.Tensor  # long [2M]: per member its first row and one past its last
    segment: torch.Tensor  # long [N]: the member of every row
    row: torch.Tensor  # long [N]: every row's number, 0 .. N-1
    listed: torch.Tensor  # long [N + 1 + M]: zeros, then the first row of each member (read when none is touched)

    def stored(self, rows: int) -> Rows:
        """Return these rows for one member whose ``rows`` change at every call (a sparse gradient's stored rows),
        built on the device: no host-to-device copy."""
        device = self.u.device
        return dataclasses.replace(self, bounds=torch.arange(2, device=device) * rows,
                                   segment=torch.zeros(rows, dtype=torch.long, device=device),
                                   row=torch.arange(rows, device=device),
                                   listed=torch.zeros(rows + 2, dtype=torch.long, device=device))


def row_draws(index: torch.Tensor, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the fixed draws ``(u, column)`` of a ``rows x cols`` gradient from its uniform sample ``index``
    (``sample_index``): ``u`` uniform in [0, 1) with ``floor(u * rows) * cols + column == index``.

    >>> index = torch.tensor([3, 40, 699])
    >>> u, col = row_draws(index, 100, 7, seed=0)
    >>> ((u * 100).long() * 7 + col).tolist(), bool(((u >= 0) & (u < 1)).all())
    ([3, 40, 699], True)
    """
    gen = torch.Generator().manual_seed(seed + (1 << 40))  # a stream apart from sample_index's
    v = torch.rand(index.numel(), dtype=torch.float64, generator=gen).mul_(1 - 2 * EDGE).add_(EDGE)
    return (index.div(cols, rounding_mode="floor").double() + v) / rows, index % cols


def rows_of(members: Sequence[int], shapes: Sequence[tuple[int, int]],
            draws: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> Rows:
    """Return the ``Rows`` of ``members`` with ``shapes`` ``(rows, cols)`` and ``draws`` ``(u, column)`` (each of
    the same length)."""
    counts, cols = torch.tensor([r for r, _ in shapes]), torch.tensor([c for _, c in shapes])
    starts = torch.cumsum(counts, 0) - counts
    built = Rows(tuple(members), torch.tensor(list(members)), torch.stack([u for u, _ in draws]),
                 torch.stack([c for _, c in draws]) - (starts * cols)[:, None], cols[:, None], cols.double(),
                 torch.stack([starts, starts + counts], 1).reshape(-1),
                 torch.repeat_interleave(torch.arange(len(shapes)), counts), torch.arange(int(counts.sum())),
                 torch.cat([torch.zeros(int(counts.sum()) + 1, dtype=torch.long), starts]))
    return dataclasses.replace(built, **{f.name: getattr(built, f.name).to(device) for f in dataclasses.fields(built)
                                         if isinstance(getattr(built, f.name), torch.Tensor)})


def pick_rows(norms: Sequence[torch.Tensor], rows: Rows, absmax: torch.Tensor
              ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Return, per member, the flat indices of its examined entries, the entries of its touched rows (float64
    ``[M]``) and its L2 norm (float64 ``[M]``), from its per-row L2 ``norms`` and its ``absmax`` (``[M]``, stored
    units). A constant number of torch calls whatever the number of members, and no host sync.

    >>> g = torch.zeros(6, 4); g[1] = 1.0; g[4, 2] = -3.0  # rows 1 and 4 touched
    >>> from ampdoctor.monitor.grad_stats import sample_index
    >>> rows = rows_of([0], [(6, 4)], [row_draws(sample_index(24, 50, 0), 6, 4, 0)], torch.device("cpu"))
    >>> (index,), covered, l2 = pick_rows([torch.linalg.vector_norm(g, dim=1)], rows, torch.tensor([3.0]))
    >>> sorted(set((index // 4).tolist())), covered.tolist(), l2.tolist()
    ([1, 4], [8.0], [3.605551275463989])
    """
    norm = torch.cat(list(norms))  # even of one: the same calls whatever the number of members
    n = norm.numel()
    touched = norm.ne(0).logical_or_((absmax < SMALL).index_select(0, rows.segment))  # NaN and inf norms: touched
    running = touched.cumsum(0)  # touched rows up to each row
    # the touched rows in order at the head of the list (the others all land on place n)
    listed = rows.listed.clone().scatter_(0, torch.where(touched, running - 1, n), rows.row)
    edges = torch.nn.functional.pad(running, (1, 0)).index_select(0, rows.bounds).view(-1, 2)
    count = edges[:, 1] - edges[:, 0]  # T: each member's touched rows
    # an examined entry's row is its member's touched row number floor(u * T); T = 0: the member's first row (all
    # its rows are zeros), listed after place n
    base = torch.where(count > 0, edges[:, 0], torch.arange(n + 1, n + 1 + count.numel(), device=norm.device))
    at = listed.take((rows.u * count[:, None]).long().add_(base[:, None]))
    l2 = torch.zeros(count.numel(), dtype=torch.float64, device=norm.device).index_add_(
        0, rows.segment, norm.double().square()).sqrt_()
    return list(torch.addcmul(rows.shift, at, rows.cols).unbind(0)), count.double().mul_(rows.width), l2
