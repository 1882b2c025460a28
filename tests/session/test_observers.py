"""Observers installed before the script's first line: clip functions bound at import, late optimizers, resumes."""

import json
import os

import pytest
import torch
from torch import nn

from ampdoctor.ui.cli import main

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def run_json(tmp_path, capsys, *argv):
    out = tmp_path / "report.json"
    code = main(["run", "--no-watch", "--json", str(out), *argv])
    captured = capsys.readouterr()
    return code, json.loads(out.read_text()), captured


def codes(report):
    return [f["code"] for f in report["findings"]]


@pytest.mark.parametrize("api", [[], ["split"]], ids=["clip_grad_norm_", "get_total_norm+clip_grads_with_norm_"])
def test_clipping_scaled_gradients_is_seen_when_the_function_was_bound_at_import(api, tmp_path, capsys):
    code, report, _ = run_json(tmp_path, capsys, os.path.join(SCRIPTS, "clip_bound_at_import.py"), *api)
    assert code == 0
    assert codes(report).count("AMP408") == 1
    assert "clip_bound_at_import.py:" in report["findings"][0]["detail"]


def test_an_optimizer_built_after_several_forwards_gets_no_false_amp405(tmp_path, capsys):
    code, report, _ = run_json(tmp_path, capsys, os.path.join(SCRIPTS, "late_optimizer.py"))
    assert code == 0
    assert "AMP405" not in codes(report) and report["ok"] is True


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint of model, optimizer (SGD momentum: no step counter) and scaler after three fp16 AMP steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, path)
    return str(path)


@pytest.mark.parametrize("extra", [[], ["--init-scale", "1024"], ["--same-process"]],
                         ids=["sgd-momentum", "non-default-init-scale", "same-process"])
def test_a_resume_without_the_scaler_state_is_amp410(extra, checkpoint, tmp_path, capsys):
    code, report, _ = run_json(tmp_path, capsys, os.path.join(SCRIPTS, "resume_without_scaler.py"), checkpoint,
                               *extra)
    assert code == 0
    amp410 = [f for f in report["findings"] if f["code"] == "AMP410"]
    assert len(amp410) == 1 and "scaler.load_state_dict() was not called" in amp410[0]["detail"]


@pytest.mark.parametrize("extra", [["--with-scaler"], ["--with-scaler", "--same-process"]])
def test_a_full_resume_is_quiet(extra, checkpoint, tmp_path, capsys):
    code, report, _ = run_json(tmp_path, capsys, os.path.join(SCRIPTS, "resume_without_scaler.py"), checkpoint,
                               *extra)
    assert code == 0
    assert "AMP410" not in codes(report)


def test_fsdp_clip_grad_norm_on_scaled_gradients_is_amp408(tmp_path, capsys):
    code, report, _ = run_json(tmp_path, capsys, os.path.join(SCRIPTS, "fsdp_clip_scaled.py"))
    assert code == 0
    [amp408] = [f for f in report["findings"] if f["code"] == "AMP408"]
    assert "fsdp_clip_scaled.py:26" in amp408["detail"]
