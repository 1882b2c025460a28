"""A model is found wherever the loop calls it, and a run whose optimizers step tensors no model seen running holds
is never an all-clear.

fairseq calls its model inside its criterion: ``FairseqTask.train_step`` runs
``loss, sample_size, logging_output = criterion(model, sample)``, and ``CrossEntropyCriterion.forward`` calls
``model(**sample["net_input"])``; the criterion is an ``nn.Module`` with no parameters
(facebookresearch/fairseq, ``fairseq/tasks/fairseq_task.py`` and ``fairseq/criterions/cross_entropy.py`` at commit
3d262bb25690e4eb2e7d3c1309b1e9c406ca4b99). The scripts below re-create that shape in a few lines: a pure fp16
model, ``AdamW(eps=1e-8)`` (0 in fp16: AMP104), no fp32 master weights (AMP103).
"""

import json
import runpy
import sys
import textwrap

import pytest
import torch

from ampdoctor.ui.cli import main

COMMON = """\
import sys
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, src_tokens):
        return self.out(torch.relu(self.proj(self.embed(src_tokens))))


def nll(net_output, target):
    lprobs = F.log_softmax(net_output.float(), dim=-1)   # fairseq's get_normalized_probs computes in fp32
    return F.nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1), reduction="sum")


class Criterion(nn.Module):
    # a FairseqCriterion: a module without parameters, handed the model and the sample
    def forward(self, model, sample):
        loss = nll(model(**sample["net_input"]), sample["target"])
        return loss, sample["target"].numel(), {"loss": loss.detach()}


def batch():
    tokens = torch.randint(0, 32, (4, 8))
    return {"net_input": {"src_tokens": tokens}, "target": tokens.roll(1, dims=1)}


model = TinyLM().to(DTYPE)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
"""

# fairseq's train_step, then its optimizer step
CRITERION_LOOP = """\
criterion = Criterion()
for update in range(4):
    sample = batch()
    loss, sample_size, logging_output = criterion(model, sample)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

DIRECT_LOOP = """\
for update in range(4):
    sample = batch()
    loss = nll(model(**sample["net_input"]), sample["target"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

# the criterion inside the step's closure
CLOSURE_LOOP = """\
criterion = Criterion()
for update in range(4):
    sample = batch()

    def closure():
        optimizer.zero_grad()
        loss, sample_size, logging_output = criterion(model, sample)
        loss.backward()
        return loss

    optimizer.step(closure)
"""

# a loss module without parameters that runs the model on given weights
FUNCTIONAL_LOOP = """\
class FunctionalLoss(nn.Module):
    def forward(self, model, params, sample):
        net_output = torch.func.functional_call(model, params, (), sample["net_input"])
        return nll(net_output, sample["target"])


loss_fn, params = FunctionalLoss(), dict(model.named_parameters())
for update in range(4):
    sample = batch()
    loss = loss_fn(model, params, sample)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

# a module without parameters that holds the model only in a closure, so the model is no child of it
WRAPPER_LOOP = """\
class Wrapper(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, sample):
        return nll(self.fn(**sample["net_input"]), sample["target"])


wrapped = Wrapper(lambda **net_input: model(**net_input))
for update in range(4):
    sample = batch()
    loss = wrapped(sample)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

SAVE = """\
if len(sys.argv) > 1:
    torch.save(model.state_dict(), sys.argv[1])
"""


def script(tmp_path, loop, dtype="torch.float16", name="train.py"):
    path = tmp_path / name
    path.write_text(COMMON.replace("TinyLM().to(DTYPE)", f"TinyLM().to({dtype})") + textwrap.dedent(loop) + SAVE)
    return str(path)


def run_json(tmp_path, capsys, path, *options):
    out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
    code = main(["run", "--json", str(out), *options, path])
    err = " ".join(capsys.readouterr().err.split())
    return code, json.loads(out.read_text()), err


def codes(report):
    return {f["code"] for f in report["findings"]}


def watched_modules(report):
    return set(report["watch"]["gradients"]["modules"])


def test_the_model_a_fairseq_criterion_calls_is_diagnosed_like_one_called_directly(tmp_path, capsys):
    _, direct, _ = run_json(tmp_path, capsys, script(tmp_path, DIRECT_LOOP, name="direct.py"))
    code, report, err = run_json(tmp_path, capsys, script(tmp_path, CRITERION_LOOP))
    assert code == 0
    assert {"AMP103", "AMP104"} <= codes(direct)
    assert codes(report) == codes(direct) and report["ok"] is False
    assert report["observed"]["models"] == 1
    assert watched_modules(report) == watched_modules(direct) == {"embed", "proj", "out"}
    assert "unwatched" not in report and "pre-flight checks only" not in err


@pytest.mark.parametrize("loop", [CLOSURE_LOOP, FUNCTIONAL_LOOP, WRAPPER_LOOP],
                         ids=["closure", "functional_call", "wrapper"])
def test_a_model_called_inside_a_module_without_parameters_is_watched(tmp_path, capsys, loop):
    code, report, err = run_json(tmp_path, capsys, script(tmp_path, loop))
    assert code == 0
    assert {"AMP103", "AMP104"} <= codes(report)
    assert watched_modules(report) == {"embed", "proj", "out"}
    assert "unwatched" not in report and "not watched" not in err


def test_a_healthy_criterion_loop_earns_its_all_clear_from_watched_steps_and_trains_the_same(tmp_path, capsys):
    path = script(tmp_path, CRITERION_LOOP, dtype="torch.float32")
    alone, watched = tmp_path / "alone.pt", tmp_path / "watched.pt"
    saved = sys.argv[:]
    sys.argv = [path, str(alone)]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved
    out = tmp_path / "report.json"
    code = main(["run", "--json", str(out), "--every", "1", "--activations", path, str(watched)])
    err = " ".join(capsys.readouterr().err.split())
    report = json.loads(out.read_text())
    assert code == 0 and report["ok"] is True and report["findings"] == []
    assert report["watch"]["steps"] == 4 and watched_modules(report) == {"embed", "proj", "out"}
    assert "no mixed-precision problems found in 4 steps" in err and "pre-flight checks only" not in err
    a, b = torch.load(alone), torch.load(watched)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


BARE_PARAMETER = """\
import torch

torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(8, 1).half())   # no nn.Module holds it
optimizer = torch.optim.AdamW([w], lr=1e-3, eps=1e-8)
for step in range(4):
    x = torch.randn(4, 8).half()
    loss = (x @ w).float().pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

FORWARD_CALLED = """\
import torch
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 1) * 0.1)

    def forward(self, x):
        return x @ self.w


net = Net()
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
for step in range(4):
    loss = net.forward(torch.randn(4, 8)).pow(2).mean()   # no nn.Module.__call__: no module hook runs
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def test_tensors_no_module_holds_are_read_by_the_pre_flight_and_the_run_is_no_all_clear(tmp_path, capsys):
    path = tmp_path / "bare.py"
    path.write_text(BARE_PARAMETER)
    code, report, err = run_json(tmp_path, capsys, str(path))
    assert code == 0
    assert "AMP104" in codes(report)   # the optimizer's eps is read though no model was seen
    assert report["ok"] is False
    [entry] = report["unwatched"]
    assert entry == {"optimizer": "optimizer[0] (AdamW)", "tensors": 1, "trained": 1, "models": [], "held": 0,
                     "free": 1, "followed": False}
    assert report["why_not_ok"].startswith("not watched: optimizer[0] (AdamW) stepped 1 of its 1 trainable tensor")
    assert "ampdoctor: not watched: optimizer[0] (AdamW)" in err


def test_a_model_run_through_forward_is_named_and_the_run_is_no_all_clear(tmp_path, capsys):
    path = tmp_path / "forward.py"
    path.write_text(FORWARD_CALLED)
    code, report, err = run_json(tmp_path, capsys, str(path))
    assert code == 0 and report["findings"] == []
    assert report["ok"] is False
    [entry] = report["unwatched"]
    assert (entry["models"], entry["held"], entry["free"]) == (["net (Net)"], 1, 0)
    assert "whose forward pass ampdoctor never saw run" in report["why_not_ok"]
    assert "ampdoctor: not watched: optimizer[0] (AdamW) stepped 1 of its 1 trainable tensor unseen: 1 in net " \
           "(Net)" in err
    assert "no mixed-precision problems found" not in err
    # every view reads it from the report: `ampdoctor report` and its page say it too
    [written] = sorted(tmp_path.glob("*.json"))
    page = tmp_path / "report.html"
    assert main(["report", str(written), "--html", str(page)]) == 0
    assert "not watched: optimizer[0] (AdamW)" in " ".join(capsys.readouterr().out.split())
    assert "not watched: optimizer[0] (AdamW)" in page.read_text()
    # and CI that asks for --strict fails on it: an unwatched model is no pass
    assert main(["report", "--strict", str(written)]) == 1
    assert "--strict: exit 1: an optimizer stepped tensors of a model ampdoctor never saw run" in \
        " ".join(capsys.readouterr().out.split())
