"""Crash explanations that fit the run: AMP608 raised by clip_grad_norm_ without a GradScaler, and the facts said
for a crash no rule knows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from ampdoctor.core.options import RunOptions
from ampdoctor.core.training import TrainingSetup
from ampdoctor.explanations.crash import explain_exception
from ampdoctor.explanations.facts import crash_facts
from ampdoctor.session.session import Session


def _clip_raises(setup: TrainingSetup, model: nn.Module) -> BaseException:
    (model(torch.randn(2, 4)) * 1e30).pow(2).sum().backward()   # 1e60 overflows: inf/NaN gradients
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    except RuntimeError as exc:
        return exc
    raise AssertionError("clip_grad_norm_ did not raise")


@pytest.mark.parametrize("autocast, expected", [(torch.bfloat16, "torch.isfinite(norm)"),
                                                 (torch.float16, "scaler = torch.amp.GradScaler(device)")])
def test_amp608_crash_without_a_scaler_gets_a_fix_for_that_setup(autocast, expected) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    setup = TrainingSetup(model, torch.optim.SGD(model.parameters(), lr=0.1), autocast_dtype=autocast)
    [finding] = explain_exception(_clip_raises(setup, model), setup)
    assert finding.code == "AMP608"
    assert "scaler.step()" not in finding.detail   # there is none to let skip it
    assert finding.fix is not None and expected in finding.fix
    if autocast == torch.bfloat16:
        assert "scaler" not in finding.fix.replace("GradScaler", "")


def test_amp608_crash_with_an_enabled_scaler_keeps_the_rules_fix() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    setup = TrainingSetup(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu"),
                          autocast_dtype=torch.float16)
    [finding] = explain_exception(_clip_raises(setup, model), setup)
    assert finding.fix is None and "scaler.step()" in finding.detail


class Head(nn.Module):
    """A classifier with a projection its forward never calls (a head left from another task)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.out, self.unused = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def test_an_unknown_crash_in_a_step_says_what_the_run_held() -> None:
    torch.manual_seed(0)
    model = Head()
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    session = Session(RunOptions(watch=False))
    session.start(TrainingSetup(model, opt, scaler))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().mean()
    scaler.scale(loss).backward()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            {}["labels"]
    except KeyError as exc:
        assert session.explain(exc) == []   # no rule knows it
    facts = session.report.exception["facts"]
    assert facts[0] == "optimizer[0] (AdamW) steps 6 float32 tensors"
    assert facts[1] == "2 of 6 trainable tensors got no gradient: unused.weight, unused.bias"
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in facts[2]
    assert facts[3] == "GradScaler('cpu') is enabled, scale 1024"
    session.finish()


def test_facts_say_nothing_they_do_not_hold() -> None:
    model = nn.Linear(2, 2).half()
    facts = crash_facts(ValueError("x"), TrainingSetup(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    assert facts == ["optimizer[0] (SGD) steps 2 float16 tensors",   # no backward ran: no gradient claim
                     "no autocast seen (around the raise, nor at the forward)", "no GradScaler"]
    assert crash_facts(ValueError("x"), None) == []


SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(2):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    if step == 1:
        raise KeyError("labels")
"""


def test_the_run_prints_the_facts_under_the_unknown_crash_in_80_columns(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--no-watch", str(script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "not a known mixed-precision" in out
    tail = out[out.index("ampdoctor: at the crash:"):]
    assert "optimizer[0] (AdamW) steps 4 float32 tensors" in " ".join(tail.split())
    assert "GradScaler('cpu') is enabled, scale" in " ".join(tail.split())
    assert all(len(line) <= 80 for line in tail.splitlines())
