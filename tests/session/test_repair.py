"""`--fix` is all or nothing (a failure part-way leaves every parameter, gradient and optimizer state as it was),
and a fixed run trains like fp32 and reports what it measured."""

import os

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


SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def _run_plainly(script, args, monkeypatch, capsys):
    """Run ``script`` with ``args`` without ampdoctor, in this process; return what it printed."""
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(script, run_name="__main__")
    return capsys.readouterr().out


def test_fix_keeps_open_clips_clamped_temperature_moving(tmp_path, monkeypatch, capsys):
    """open_clip's ``logit_scale.clamp_(0, math.log(100))`` after every step under ``--fix``: the bf16 temperature
    follows fp32, and "no findings left" rests on sampled lost updates (the script's docstring cites
    mlfoundations/open_clip, src/open_clip_train/legacy_train.py at 89fb801f1e6087880e951fc8354b8a2077b79c6d)."""
    import json

    from ampdoctor.ui.cli import main

    script, out = os.path.join(SCRIPTS, "open_clip_temperature.py"), tmp_path / "r.json"
    reference = [float(line.split()[3]) for line in _run_plainly(script, ["fp32"], monkeypatch, capsys).splitlines()]
    assert main(["run", "--fix", "--json", str(out), script]) == 0
    captured = capsys.readouterr()
    fixed = [float(line.split()[3]) for line in captured.out.splitlines() if line.startswith("step ")]
    # It used to stay at log(1 / 0.07) in bf16 (2.65625, a temperature of 14.25) for every step: the clamp rewrote
    # the bf16 copy, and the fp32 master was reloaded from it, losing each step (5e-3, below half an ulp: 2**-7).
    # Now the bf16 copy is the fp32 master rounded: within half an ulp of the fp32 run, plus the bf16 forward's
    # small drift (Adam's step is lr * m / sqrt(v), nearly independent of the gradient's rounding).
    assert reference[-1] < 2.65625 - 2 * 2**-6   # fp32 moves by more than 2 bf16 ulps
    assert all(abs(f - r) <= 2**-7 + 1e-3 for f, r in zip(fixed, reference)) and len(fixed) == 8
    err = " ".join(captured.err.split())
    assert "no findings left after" in err
    lost = json.loads(out.read_text())["watch"]["lost_updates"]
    # earned: every sampled step but the last was checked for updates its masters lost before the next step
    assert lost["sampled_steps"] == 7 and lost["params"]["logit_scale"] == {"dtype": "bfloat16", "lost_fraction": 0.0}


@pytest.mark.parametrize("fix", [False, True], ids=["plain", "--fix"])
def test_litgpt_gradient_accumulation_uses_every_micro_batch(fix, tmp_path, monkeypatch, capsys):
    """litgpt's 16-true/bf16-true finetune with 2 micro-batches a step, on a real Lightning Fabric (CPU runs
    bf16-true): no AMP612 with or without ``--fix``, and ``--fix``'s updates are fp32 accumulation's (the script's
    docstring cites Lightning-AI/litgpt, litgpt/finetune/full.py at 26857050fe3ff627cd714fe92f5838f51a3d5efa)."""
    import json

    from ampdoctor.ui.cli import main

    script, out = os.path.join(SCRIPTS, "litgpt_accumulation.py"), tmp_path / "r.json"
    assert main(["run", *(["--fix"] if fix else []), "--json", str(out), script, "bf16-true"]) == 0
    updates = json.loads(capsys.readouterr().out.splitlines()[-1])
    codes = [f["code"] for f in json.loads(out.read_text())["findings"]]
    # it said "7 of 16 backward calls had gradients that no optimizer step used" under --fix: MasterWeights' zeroed
    # bf16 placeholder in .grad between micro-batches was taken for a reset
    assert "AMP612" not in codes
    assert "AMP103" in codes   # pure bf16 AdamW: kept as info under --fix, which repaired it
    if not fix:
        return

    def flat(printed):
        return torch.cat([torch.tensor(u) for u in json.loads(printed.splitlines()[-1])])

    ours = torch.cat([torch.tensor(u) for u in updates])
    both = flat(_run_plainly(script, ["32-true"], monkeypatch, capsys))
    one = flat(_run_plainly(script, ["32-true", "drop"], monkeypatch, capsys))

    def error(update):
        return ((update - both).norm() / both.norm()).item()

    # the update read off the bf16 weights is off by up to half an ulp of each weight (|w| * 2**-9, about 2% of
    # these updates) and the bf16 forward; an fp32 run that used one micro-batch a step is 85% off
    assert error(one) > 0.5
    assert error(ours) < 0.05


def test_fix_still_finds_a_micro_batch_dropped_before_the_step(tmp_path, capsys):
    import json

    from ampdoctor.ui.cli import main

    script, out = os.path.join(SCRIPTS, "litgpt_accumulation.py"), tmp_path / "r.json"
    assert main(["run", "--fix", "--json", str(out), script, "bf16-true", "drop"]) == 0
    findings = {f["code"]: f for f in json.loads(out.read_text())["findings"]}
    assert "AMP612" in findings and "7 of 16 backward calls" in findings["AMP612"]["detail"]
