"""The fixes of AMP601 and AMP608 fit what the watch saw: an optimizer step that wrote NaN weights is no overflow,
and a run without a GradScaler gets no ``scaler.unscale_`` advice."""

from __future__ import annotations

import io

import torch
from rich.console import Console
from torch import nn

from ampdoctor.core.catalog import get_rule
from ampdoctor.monitor.watcher import watch
from ampdoctor.ui.console import fixes_panel


def _adam_eps_run() -> list:
    """Pure fp16 with AdamW's default eps=1e-8, which is 0 in fp16 (AMP104): embedding rows that get no gradient
    step 0/0 = NaN, and the next batch that uses them makes the Embedding's output NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Flatten(), nn.Linear(4 * 16, 64)).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [torch.randint(0, 32, (8, 4)), torch.randint(32, 64, (8, 4))]
    with watch(model, opt, every=1, activations=True) as w:
        for step in range(4):
            ids = batches[min(step, 1)]
            loss = nn.functional.cross_entropy(model(ids).float(), ids[:, 0])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w.findings()


def test_amp601_on_weights_an_optimizer_step_made_nan_gives_the_step_fix_not_the_overflow_fix() -> None:
    findings = _adam_eps_run()
    amp601 = next(f for f in findings if f.code == "AMP601")
    assert "0 (Embedding)" in amp601.where and "weights" in amp601.detail   # its own detail says so
    assert amp601.fix is not None
    assert "eps=1e-4" in amp601.fix and "MasterWeights" in amp601.fix   # AMP104's own fix
    assert "enabled=False" not in amp601.fix and "module(x.float())" not in amp601.fix   # no overflow advice
    assert all(len(line) <= 76 for line in amp601.fix.splitlines())   # 80 columns with the 4-column indent

    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(fixes_panel([amp601]))
    shown = out.getvalue()
    assert "eps=1e-4" in shown and "y = module(x.float())" not in shown
    assert max(map(len, shown.splitlines())) <= 80


def test_amp601_of_a_real_overflow_keeps_the_rules_fix() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with torch.no_grad():
        model[1].weight.fill_(1e3)   # 16 inputs of ~1e2 times 1e3: above fp16's 65504, inf
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with watch(model, opt, scaler, every=1, activations=True) as w:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.full((4, 16), 100.0)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    amp601 = next(f for f in w.findings() if f.code == "AMP601")
    assert amp601.where == "1 (Linear)" and amp601.fix is None   # the rule's overflow fix is the right one here


def _inf_grads(model: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype | None) -> list:
    with watch(model, opt, every=1) as w:
        for _ in range(2):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                out = model(torch.randn(4, 8))
            (out.float() * 1e30).pow(2).sum().backward()   # 1e60 overflows: inf loss, inf/NaN gradients
            opt.step()
            opt.zero_grad()
    return [f for f in w.findings() if f.code == "AMP608"]


def test_amp608_without_a_scaler_in_bf16_says_no_scaler_unscale() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    found = _inf_grads(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.bfloat16)
    assert found and found[0].fix is not None
    assert "scaler" not in found[0].fix.replace("GradScaler", "")   # no scaler.unscale_/step/update
    assert "torch.isfinite(norm)" in found[0].fix
    assert "scaler.unscale_(opt)" in get_rule("AMP608").fix   # the rule's fix assumes one


def test_amp608_with_fp16_parameters_and_no_scaler_points_at_master_weights() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 2).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, opt, every=1) as w:
        for _ in range(2):
            (model(torch.randn(4, 8).half()).float() * 1e30).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    fix = next(f for f in w.findings() if f.code == "AMP608").fix
    assert fix is not None and "MasterWeights" in fix and "scaler.unscale_" not in fix
