"""The watch summary's gradient table read from real watched runs: what its header says about clipping, and which
columns it keeps at 80 columns."""

from __future__ import annotations

import io
import re

import torch
from rich.console import Console
from torch import nn

from ampdoctor.monitor.watcher import watch
from ampdoctor.ui.watch_view import render_watch


def _render(data: dict, width: int = 80) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.soft_wrap = True   # piped, as ampdoctor's own console
    console.print(render_watch(data, []))
    return console.file.getvalue()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def test_the_header_says_the_global_norm_is_after_clipping_and_gives_the_norm_before():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    with watch(model, optimizer, every=1) as w:
        for _ in range(3):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
            w.note_clip(norm)   # what `ampdoctor run` and the callbacks do for the script's clip_grad_norm_
            before = float(norm)
            optimizer.step()
    data = w.summary_data()
    head = " ".join(_render(data).split())   # the header wraps at 80 columns
    match = re.search(r"global norm (\S+) after clipping; (\S+) before\)", head)
    assert match, head
    assert float(match[1]) <= 1.01e-3 and float(match[2]) == float(f"{before:.3g}")   # the summary's numbers
    assert data["gradients"]["pre_clip_norm"] == before


def test_without_a_clip_the_header_gives_the_global_norm_alone():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, optimizer, every=1) as w:
        nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
        optimizer.step()
    head = " ".join(_render(w.summary_data()).split())
    assert re.search(r"\(unscaled; global norm \S+\)", head) and "clipping" not in head, head


def test_a_bf16_autocast_run_keeps_its_bf16_column_at_80_columns():
    # fp32 weights, bf16 autocast, no scaler: the forward's autocast dtype names the format (it used to be "either",
    # and the bf16 column, listed last, was the first dropped at 80 columns)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, optimizer, every=1) as w:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(torch.randn(8, 16)).float(), torch.randn(8, 1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    data = w.summary_data()
    assert data["formats"] == ["bf16"]
    text = _render(data)
    header = next(line for line in text.splitlines() if line.startswith("module"))
    assert "bf16 u/o" in header and "fp16 u/o" not in header, text
    assert max(map(len, text.splitlines())) <= 80


def test_a_clip_that_shrank_nothing_is_not_called_clipping():
    # max_norm above the norm, and a clip over a consumed filter (it returns 0): the gradients are the unclipped ones
    for clip in ("above", "nothing"):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        with watch(model, optimizer, every=1) as w:
            nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
            w.note_clip(torch.nn.utils.clip_grad_norm_(model.parameters() if clip == "above" else [], 1e6))
            optimizer.step()
        head = " ".join(_render(w.summary_data()).split())
        assert "clipping" not in head and re.search(r"\(unscaled; global norm \S+\)", head), head


def test_an_optimizer_over_a_replaced_models_tensors_is_no_green_verdict():
    # the model was re-created after its optimizer was built: no AMP617 names the optimizer's tensors (they are no
    # part of what trains), and the verdict does not call the run clean either
    stale = _model()
    optimizer = torch.optim.SGD(stale.parameters(), lr=0.01)
    model = _model()
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    with watch(model, optimizer, every=1) as w:
        for _ in range(2):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert w.findings() == []
    text = " ".join(_render(w.summary_data()).split())
    assert ("4 tensors the optimizer steps that belong to no model that ran (none had a gradient); so this is no "
            "all-clear") in text
