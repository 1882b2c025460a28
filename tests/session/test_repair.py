"""`--fix` is all or nothing: a failure part-way leaves every parameter, gradient and optimizer state as it was."""

import pytest
import torch
from torch import nn

import ampdoctor.repairs.master_weights
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup
from ampdoctor.session.repair import RunRepairs


def test_a_failing_fix_rolls_back_what_it_already_changed(monkeypatch):
    torch.manual_seed(0)
    upcast_me = nn.Linear(4, 4).half()     # runs under autocast: upcast first
    master_me = nn.Linear(4, 2).half()     # no autocast: fp32 master weights, which fail here
    opts = [torch.optim.Adam(m.parameters(), eps=1e-4) for m in (upcast_me, master_me)]
    for opt in opts:
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.full_like(p, 0.5)
        opt.step()   # fp16 Adam state exists, so the upcast migrates it
    before = [(opt, p, p.data, p.grad, dict(opt.state[p])) for opt in opts for p in opt.param_groups[0]["params"]]

    def refuse(self, optimizer):
        raise RuntimeError("injected by the test: the second repair fails")

    monkeypatch.setattr(ampdoctor.repairs.master_weights.MasterWeights, "__init__", refuse)
    report, events = Report(), []
    setup = TrainingSetup([upcast_me, master_me], opts)
    with pytest.raises(RuntimeError, match="injected"):
        RunRepairs(report, events.append).apply(setup, [upcast_me, master_me],
                                               {id(upcast_me): torch.float16, id(master_me): None})
    assert report.changes == []
    assert any("rolled back, nothing changed" in e for e in events)
    for opt, p, data, grad, state in before:
        # the very same storage (p.data makes a new alias object on each access), so bit for bit the old values
        assert p.dtype == torch.float16 and p.data_ptr() == data.data_ptr() and p.grad is grad
        assert all(opt.state[p][k] is v for k, v in state.items())


def test_a_successful_fix_changes_every_model():
    upcast_me, master_me = nn.Linear(4, 4).half(), nn.Linear(4, 2).half()
    opts = [torch.optim.Adam(m.parameters(), eps=1e-4) for m in (upcast_me, master_me)]
    report = Report()
    repairs = RunRepairs(report, lambda line: None)
    repairs.apply(TrainingSetup([upcast_me, master_me], opts), [upcast_me, master_me],
                  {id(upcast_me): torch.float16, id(master_me): None})
    assert upcast_me.weight.dtype == torch.float32 and master_me.weight.dtype == torch.float16
    assert any("fp32 master weight added" in c for c in report.changes)
    repairs.detach()


def test_fix_sees_the_autocast_accelerate_enters_inside_forward(tmp_path, capsys):
    # accelerate wraps model.forward with autocast(bf16): the forward pre-hook runs before it starts, so without
    # knowing accelerate --fix would pick fp32 master weights (the no-autocast remedy) instead of an upcast
    import json
    import os

    from ampdoctor.ui.cli import main

    out = tmp_path / "r.json"
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "accelerate_bf16_model.py")
    code = main(["run", "--fix", "--no-watch", "--json", str(out), script])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "upcast trainable parameters to float32 (forward runs under autocast)" in " ".join(captured.err.split())
    assert "master weight" not in captured.err
    assert captured.out.count("weight dtype torch.float32") == 5
    report = json.loads(out.read_text())
    assert [f["code"] for f in report["fixed"]] == ["AMP103"]
    assert [(f["code"], f["severity"]) for f in report["findings"]] == [("AMP103", "info")]  # kept, as repaired


def test_run_fix_leaves_a_forward_that_runs_with_a_frozen_half_norm(capsys):
    # It used to upcast the embedding and stop at the next forward: the fp32 embedding output met the frozen
    # fp16 LayerNorm under CPU autocast ("mixed dtype (CPU): expect parameter to have scalar type of Float").
    import os

    from ampdoctor.ui.cli import main

    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "frozen_norm_half.py")
    assert main(["run", "--fix", "--no-watch", script]) == 0
    captured = capsys.readouterr()
    assert "done" in captured.out and "and 2 norm tensors upcast to float32" in captured.err


FROZEN_NORMS = """\
import torch
from torch import nn
torch.manual_seed(0)
body = nn.Sequential(*[m for _ in range(13) for m in (nn.Linear(16, 16), nn.LayerNorm(16))])
model = nn.Sequential(body, nn.Linear(16, 1)).half()
body.requires_grad_(False)             # a frozen half base, a trainable half head
opt = torch.optim.SGD(model[1].parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(8, 16)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_fix_says_the_frozen_norms_it_upcast_in_one_line(tmp_path, capsys):
    import json

    from ampdoctor.ui.cli import main

    script, out = tmp_path / "train.py", tmp_path / "r.json"
    script.write_text(FROZEN_NORMS)
    assert main(["run", "--fix", "--no-watch", "--json", str(out), str(script)]) == 0
    err = capsys.readouterr().err
    said = err[err.index("changes\n") + len("changes\n"):err.index("ampdoctor --fix resolved")]
    assert said.splitlines()[:2] == ["  1.weight: upcast torch.float16 -> torch.float32",
                                     "  1.bias: upcast torch.float16 -> torch.float32"]
    assert " ".join(" ".join(said.splitlines()[2:]).split()) == (
        "and 26 norm tensors upcast to float32 (each one is in the JSON report written with --json PATH)")
    changes = json.loads(out.read_text())["changes"]
    assert len(changes) == 28 and "0.1.weight: upcast frozen norm torch.float16 -> torch.float32" in changes
