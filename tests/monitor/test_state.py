"""The state check (``monitor/parts/state.py``): buffers, optimizer state and averaged copies finite after each
sampled step, on real BatchNorm, AdamW, AveragedModel and GradScaler (AMP707)."""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor.monitor.watcher import Watch


def _bn_run(outlier: bool, averaged: bool = False) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    ema = torch.optim.swa_utils.AveragedModel(model, use_buffers=True) if averaged else None
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with Watch(model, opt, scaler, every=1) as watch:
        for step in range(4):
            x = torch.randn(32, 8) * (1e5 if outlier and step == 1 else 1)   # one batch overflows fp16
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if ema is not None:
                ema.update_parameters(model)
    return [f for f in watch.findings() if f.code == "AMP707"]


def test_batchnorm_statistics_poisoned_on_a_skipped_step_are_named_with_it():
    found = _bn_run(outlier=True)
    assert [(f.where, f.step) for f in found] == [("1 (BatchNorm1d)", 1)]
    assert "running_mean, running_var hold inf/NaN after step 1 (finite after step 0); the loss scaler skipped " \
           "step 1" in found[0].detail
    assert _bn_run(outlier=False) == []


def test_an_averaged_copy_poisoned_too_is_named():
    found = _bn_run(outlier=True, averaged=True)
    assert [f.where for f in found] == ["1 (BatchNorm1d)", "AveragedModel (torch.optim.swa_utils)"]
    assert "the averaged copy's 1.running_mean, 1.running_var hold inf/NaN" in found[1].detail


def test_optimizer_state_is_checked_unless_its_weight_is_not_finite_too():
    def run(poison_weight: bool) -> list:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with Watch(model, opt, every=1) as watch:
            for step in range(3):
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    with torch.no_grad():
                        # inf in the second moment: that entry's updates are 0 from now on, the weight stays finite
                        opt.state[model.weight]["exp_avg_sq"][0, 0] = float("inf")
                        if poison_weight:
                            model.weight[0, 0] = float("nan")
        return [f for f in watch.findings() if f.code == "AMP707"]
    found = run(poison_weight=False)
    assert [f.where for f in found] == ["optimizer"] and "exp_avg_sq of weight" in found[0].detail
    assert run(poison_weight=True) == []   # the weight is NaN: AMP616 says it
