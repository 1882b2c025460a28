"""The deferred read-back: a watch that reads each sampled step's copy one step later (what it does on CUDA, so that
``every=1`` does not drain the pipeline) must see exactly what a watch that reads at once sees.

``host_sync.DEFER_ON_CPU`` runs the deferred bookkeeping on CPU: the copy is taken at the end of a sampled step and
read at the end of the next one, while that step already writes new loss-scale rows and lost-update counts. The
first version reset those when reading and lost the step in between; on an H200 that shifted a skipped step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.core.host_reads import process_reads
from ampdoctor.core.records import read_log
from ampdoctor.monitor import host_sync

SKIPS = (3, 4, 9)  # the forward overflows fp16 at these steps: inf gradients, the GradScaler skips them


def train(log_dir: Path, *, every: int, activations: bool, steps: int = 14,
          device: str = "cpu") -> tuple[ampdoctor.Watch, list[dict], int]:
    torch.manual_seed(0)
    copies = process_reads().get("watch", 0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    gen = torch.Generator().manual_seed(1)
    w = ampdoctor.watch(model, opt, scaler, every=every, dense=0, activations=activations, log_dir=str(log_dir))
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=gen).to(device), torch.randn(4, 1, generator=gen).to(device)
        if step in SKIPS:
            x = x * 1e6  # above 65504 after the first fp16 Linear
        with torch.autocast(device, dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    w.detach()
    _, records, problems = read_log(log_dir)
    assert problems == []
    return w, records, process_reads()["watch"] - copies


def comparable(w: ampdoctor.Watch, records: list[dict], copies: int) -> dict:
    """What both reads must agree on. Not ``host_syncs``: it also counts the activation monitor's own reads, and
    an escalation arms that monitor a step later when reads are deferred. The sampled steps' copies must agree."""
    summary = w.summary_data()
    for key in ("seconds_inside", "log_path", "host_syncs"):
        summary.pop(key)
    steps = [{k: v for k, v in r.items() if k != "t"} for r in records if r.get("type") == "step"]
    return {"summary": summary, "steps": steps, "findings": [f.to_dict() for f in w.findings()],
            "sampled": w.sampled_steps, "copies": copies}


@pytest.mark.parametrize("every, activations", [(3, False), (1, True), (2, True)])
def test_a_deferred_read_sees_what_an_immediate_read_sees(tmp_path, monkeypatch, every, activations) -> None:
    at_once = comparable(*train(tmp_path / "now", every=every, activations=activations))
    monkeypatch.setattr(host_sync, "DEFER_ON_CPU", True)
    later = comparable(*train(tmp_path / "later", every=every, activations=activations))
    assert at_once["summary"]["scale"]["skipped_steps"] == list(SKIPS)  # the run does what it is meant to
    assert later["summary"]["scale"] == at_once["summary"]["scale"]
    assert later["steps"] == at_once["steps"]
    assert later == at_once


def test_escalation_arms_the_activation_monitor_one_step_later_when_reads_are_deferred(tmp_path, monkeypatch) -> None:
    # every=1: each copy is read when the next step ends, so the skip at step 3 is known at the end of step 4 and
    # the activation monitor hooks step 5 instead of 4; everything else is the same
    at_once = comparable(*train(tmp_path / "now", every=1, activations=False))
    monkeypatch.setattr(host_sync, "DEFER_ON_CPU", True)
    later = comparable(*train(tmp_path / "later", every=1, activations=False))
    armed = lambda run: [r["step"] for r in run["steps"] if (r.get("activations") or {}).get("sampled")]  # noqa
    assert armed(at_once) == [4, 10]  # after the first skip of each episode (steps 3 and 9)
    assert armed(later) == [5, 11]
    strip = lambda run: [{k: v for k, v in r.items() if k != "activations"} for r in run["steps"]]  # noqa
    assert strip(later) == strip(at_once)
    assert later["summary"]["scale"] == at_once["summary"]["scale"]
    assert later["summary"]["gradients"] == at_once["summary"]["gradients"]
    assert later["sampled"] == at_once["sampled"] == 14 and later["copies"] == at_once["copies"] == 14


def test_the_deferred_copy_is_read_at_the_end_of_the_next_step(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(host_sync, "DEFER_ON_CPU", True)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    w = ampdoctor.watch(model, opt, scaler, every=1, dense=0)
    seen = []
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(2, 4)).float().sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append(w.sampled_steps)
    # step k's values are read when step k + 1 ends; but step 2, looked at by the activation monitor armed after
    # step 0's skip, is read at once (a non-finite output is re-run before the weights move again)
    assert seen == [0, 1, 3]
    w.detach()
    # 3 copies; the armed activation monitor's values are in step 2's
    assert w.sampled_steps == 3 and w.host_syncs == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("every", [1, 3])
def test_on_cuda_the_deferred_read_sees_what_an_immediate_read_sees(tmp_path, monkeypatch, every) -> None:
    # the real thing: a non_blocking copy into pinned memory, read after its event at the end of the next step
    monkeypatch.setattr(host_sync, "DEFER", False)
    at_once = comparable(*train(tmp_path / "now", every=every, activations=True, device="cuda"))
    monkeypatch.setattr(host_sync, "DEFER", True)
    later = comparable(*train(tmp_path / "later", every=every, activations=True, device="cuda"))
    assert at_once["summary"]["scale"]["skipped_steps"] == list(SKIPS)
    assert later == at_once
