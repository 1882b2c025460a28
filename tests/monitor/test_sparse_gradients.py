"""Gradients that only some rows carry: an embedding's, dense or ``sparse=True``. ``GradStats`` examines the rows the
batch touched (``ampdoctor.monitor.grad_rows``), so their fp16 underflow is measured, and the zeros are the rest.

The shape is open_clip's text tower: mlfoundations/open_clip, src/open_clip/transformer.py (commit 89fb801f1e60),
``TextTransformer`` defaults to a vocabulary of 49408 tokens and a width of 512 and embeds its tokens with an
``nn.Embedding`` of that size. A batch touches the rows of its own tokens only: with 16 distinct tokens, the 4096
entries sampled uniformly from its 25M held about one entry of those rows (often none), and the watch showed
``zeros 100%`` and no ``min|g|>0``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from op_count import CountOps
from rich.console import Console
from torch import nn

from ampdoctor.monitor.grad_stats import COL, FLOOR, GradStats
from ampdoctor.monitor.gradients import rows_to_dicts
from ampdoctor.monitor.watcher import watch

VOCAB, WIDTH = 49408, 512  # open_clip's TextTransformer defaults
SCALE = 2.0**8
# ops whose output size depends on the data: a host sync on CUDA (coalesce reads the number of distinct rows)
SYNCING = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "coalesce",
           "_coalesce", "item"}


def token_gradients(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Return ``[tokens, WIDTH]`` gradient rows: magnitudes 2**-36 .. 2**-12 (all above the floor, 2**-24 of the
    largest), so at loss scale 2**8 those at most 2**-33 round to 0 in fp16 (about 1/8), and 1 in 8 entries is 0."""
    magnitude = torch.exp2(torch.empty(tokens, WIDTH).uniform_(-36, -12, generator=gen))
    sign = torch.randint(2, (tokens, WIDTH), generator=gen) * 2 - 1
    return magnitude * sign * (torch.rand(tokens, WIDTH, generator=gen) >= 1 / 8)


def embedding_grad(tokens: torch.Tensor, rows: torch.Tensor, sparse: bool = False) -> torch.Tensor:
    """Return the gradient of an open_clip-sized token embedding after a backward whose upstream gradient at each
    position is its row of ``rows``."""
    embed = nn.Embedding(VOCAB, WIDTH, sparse=sparse)
    (embed(tokens) * rows).sum().backward()
    return embed.weight.grad


def exact(g: torch.Tensor) -> dict[str, float]:
    """The statistics of a dense gradient at loss scale ``SCALE``, from every entry of its touched rows."""
    a = g.double().abs()
    touched = a[a.amax(1) > 0]
    signal = touched > FLOOR * float(a.max())
    scaled = touched * SCALE
    return {"nonzero": int((a > 0).sum()), "min_nonzero": float(touched[touched > 0].min()),
            "fp16_underflow": float(((scaled <= 2.0**-25) & signal).sum() / signal.sum()),
            "fp16_subnormal": float(((scaled < 2.0**-14) & signal).sum() / signal.sum())}


def stats(grads: list[torch.Tensor], **kwargs) -> list[dict[str, float]]:
    names = [str(i) for i in range(len(grads))]
    found = rows_to_dicts(GradStats([g.numel() for g in grads], **kwargs).compute(grads, torch.tensor(SCALE)).tolist(),
                          names)
    return [found[n] for n in names]


def test_an_open_clip_token_embedding_is_examined_in_the_rows_its_batch_touched():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randperm(VOCAB, generator=gen)[:16]  # 16 distinct tokens: 16 of 49408 rows touched
    g = embedding_grad(tokens, token_gradients(16, gen))
    want = exact(g)
    got = stats([g])[0]
    assert got["min_nonzero"] < 2.0**-30 and got["min_nonzero"] >= want["min_nonzero"]  # the smallest examined
    # 4096 entries of the touched rows: the shares are within sampling error (±1.1% at 95% for 1/8)
    assert got["fp16_underflow"] == pytest.approx(want["fp16_underflow"], abs=0.025)
    assert got["fp16_subnormal"] == pytest.approx(want["fp16_subnormal"], abs=0.025)
    # the zeros: the untouched rows exactly, the zeros in the touched rows estimated
    assert (1 - got["zero_frac"]) * g.numel() == pytest.approx(want["nonzero"], rel=0.05)
    assert got["absmax"] == pytest.approx(float(g.abs().max()), rel=1e-6)
    assert got["l2"] == pytest.approx(float(g.double().norm()), rel=1e-5)


def test_a_single_touched_row_and_an_all_zero_matrix():
    gen = torch.Generator().manual_seed(1)
    one = torch.zeros(8192, 64)
    one[4321] = torch.exp2(torch.empty(64).uniform_(-36, -20, generator=gen))  # at 2**8, 2**-33 and below flush
    got_one, got_zero = stats([one, torch.zeros(8192, 64)])
    # 4096 draws from one row of 64 entries examine every one of them
    assert got_one["min_nonzero"] == float(one[4321].min())
    assert got_one["zero_frac"] == 1 - 64 / one.numel()
    assert got_one["fp16_underflow"] == pytest.approx(float((one[4321] * SCALE <= 2.0**-25).double().mean()),
                                                      abs=0.03)
    assert got_zero["zero_frac"] == 1.0 and got_zero["min_nonzero"] == math.inf
    assert got_zero["fp16_underflow"] == 0.0 and got_zero["l2"] == 0.0


def test_a_sparse_embedding_gradient_gives_the_statistics_of_the_dense_one():
    gen = torch.Generator().manual_seed(2)
    tokens = torch.cat([torch.randperm(VOCAB, generator=gen)[:16], torch.tensor([7])])
    tokens[0] = 7  # token 7 twice: the sparse gradient lists its row twice, to be summed
    rows = token_gradients(17, gen)
    dense, sparse = embedding_grad(tokens, rows), embedding_grad(tokens, rows, sparse=True)
    assert sparse.is_sparse and not sparse.is_coalesced()
    (got_dense,), (got_sparse,), (exact_row,) = stats([dense]), stats([sparse]), stats([dense], sample=None)
    # the same draws (of parameter 0) over the same touched rows, in the same order: the same entries examined
    for key, value in got_dense.items():
        assert got_sparse[key] == pytest.approx(value, rel=1e-6, abs=0), key
    assert got_sparse["fp16_underflow"] == pytest.approx(exact_row["fp16_underflow"], abs=0.025)
    assert got_sparse["zero_frac"] == pytest.approx(exact_row["zero_frac"], abs=1e-5)


def test_a_small_sparse_gradient_is_examined_whole():
    embed = nn.Embedding(100, 8, sparse=True)
    embed(torch.tensor([3, 3, 50])).sum().backward()
    got = stats([embed.weight.grad])[0]
    assert got["zero_frac"] == 1 - 16 / 800 and got["min_nonzero"] == 1.0 and got["l2"] == pytest.approx(
        math.sqrt(8 * 4 + 8))


def test_a_dense_matrix_examines_the_entries_of_its_uniform_sample():
    # Every row touched: the row draws pick the entries of the uniform sample that a flat tensor of the same size
    # examines, so the counts are the same, not only their distribution. (Holds before rows were examined too.)
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(300, 50, generator=gen) * torch.exp2(torch.empty(300, 50).uniform_(-30, 0, generator=gen))
    g[::7, ::3] = 0.0
    matrix, flat = stats([g])[0], stats([g.reshape(-1)])[0]
    for key, value in flat.items():
        assert matrix[key] == pytest.approx(value, rel=1e-6, abs=0), key
    whole = stats([g], sample=None)[0]
    assert matrix["fp16_underflow"] == pytest.approx(whole["fp16_underflow"], abs=0.025)
    assert matrix["zero_frac"] == pytest.approx(whole["zero_frac"], abs=0.025)


def test_a_tensor_of_tiny_entries_counts_every_row_as_touched():
    # 2**-80 squares to 0 in float32: every row norm is 0. An abs-max below 2**-50 counts every row as touched.
    g = torch.full((100, 64), 2.0**-80)
    got = stats([g], floor=0.0)[0]
    assert got["zero_frac"] == 0.0 and got["min_nonzero"] == 2.0**-80 and got["fp16_underflow"] == 1.0


# ---- the hot path: no host sync, and a constant number of calls per group --------------------------------------


def test_examining_by_rows_adds_no_host_sync():
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randperm(VOCAB, generator=gen)[:8]
    rows = token_gradients(8, gen)
    grads = [embedding_grad(tokens, rows), embedding_grad(tokens, rows, sparse=True), torch.randn(5000)]
    computer = GradStats([g.numel() for g in grads])
    computer.compute(grads, torch.tensor(SCALE))  # builds the plans
    with CountOps() as mode:
        out = computer.compute(grads, torch.tensor(SCALE))
    assert out[:, COL["has_grad"]].tolist() == [1.0, 1.0, 1.0]
    assert not SYNCING & set(mode.ops), dict(mode.ops)
    # on CPU, finish() reads two flags per group (free there: the module docstring), as without rows
    assert mode.ops["_local_scalar_dense"] == 2, dict(mode.ops)


def _grown_ops(small: list[torch.Tensor], large: list[torch.Tensor]) -> dict[str, int]:
    """Return the ops one compute of ``large`` runs beyond one of ``small`` (after each built its plan)."""
    counts = []
    for grads in (small, large):
        computer = GradStats([g.numel() for g in grads])
        computer.compute(grads, None)
        with CountOps() as mode:
            computer.compute(grads, None)
        counts.append(mode.ops)
    return {op: counts[1][op] - counts[0].get(op, 0) for op in counts[1] if counts[1][op] != counts[0].get(op, 0)}


def test_a_matrix_examined_by_rows_costs_its_two_passes_and_one_gather():
    # per matrix: its row norms (instead of a dot), its aminmax and the gather of its examined entries; picking the
    # rows is a constant number of calls per group
    gen = torch.Generator().manual_seed(5)
    matrices = [torch.randn(100, 50, generator=gen) for _ in range(5)]
    grown = _grown_ops(matrices[:1], matrices)
    assert {op: grown.pop(op, 0) for op in ("linalg_vector_norm", "aminmax", "index_select")} == dict.fromkeys(
        ("linalg_vector_norm", "aminmax", "index_select"), 4), grown
    assert set(grown) <= {"view", "reshape", "_reshape_alias"}, grown


# ---- end to end ----------------------------------------------------------------------------------------------------


class TextTower(nn.Module):
    """An open_clip-sized token embedding whose gradient rows are fixed (``upstream``): a loss linear in it."""

    def __init__(self, upstream: torch.Tensor, sparse: bool) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, 16, sparse=sparse)
        self.register_buffer("upstream", upstream)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.token_embedding(tokens) * self.upstream).sum()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_the_watch_shows_the_embedding_s_smallest_gradient_and_its_underflow(sparse):
    gen = torch.Generator().manual_seed(6)
    upstream = torch.exp2(torch.empty(16, 16).uniform_(-36, -20, generator=gen))  # at 2**8, 2**-33 and below flush
    torch.manual_seed(0)
    model = TextTower(upstream, sparse)
    tokens = torch.randperm(VOCAB, generator=gen)[:16]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    with watch(model, opt, scaler, every=1) as w:
        for _ in range(2):
            scaler.scale(model(tokens)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    embedding = w.summary_data()["gradients"]["modules"]["token_embedding"]
    share = float((upstream * SCALE <= 2.0**-25).double().mean())  # every entry is signal (within 2**-16 of the max)
    assert math.isfinite(embedding["min_nonzero"]) and embedding["min_nonzero"] < 2.0**-30
    assert embedding["fp16_underflow"] == pytest.approx(share, abs=0.03)
    assert embedding["zero_frac"] == pytest.approx(1 - 16 / VOCAB, abs=1e-6)
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(w.summary())
    line = next(line for line in console.file.getvalue().splitlines() if line.startswith("token_embedding"))
    min_nonzero = line.split()[3]  # module, L2, max|g|, min|g|>0, zeros, ...
    assert min_nonzero != "-" and float(min_nonzero) < 2.0**-30, line


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_rows_and_sparse_rows_never_sync_and_match_cpu():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.cat([torch.randperm(VOCAB, generator=gen)[:16], torch.tensor([7])])
    rows = token_gradients(17, gen)
    grads = [embedding_grad(tokens, rows), embedding_grad(tokens, rows, sparse=True), torch.randn(5000)]
    want = GradStats([g.numel() for g in grads]).compute(grads, torch.tensor(SCALE))
    cuda = [g.cuda() for g in grads]
    scale = torch.tensor(SCALE, device="cuda")
    computer = GradStats([g.numel() for g in grads])
    computer.compute(cuda, scale)  # the plans' tensors are built (and copied) once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        got = computer.compute(cuda, scale)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=0, equal_nan=True)
