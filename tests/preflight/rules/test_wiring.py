"""AMP301–AMP302: optimizers that step other tensors than the model trains."""

import pytest
import torch
from torch import nn

from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup
from ampdoctor.preflight.rules.wiring import (
    confirm_wiring,
    optimizer_tensors_not_in_model,
    params_missing_from_optimizer,
)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 4))


# ---- AMP301 -----------------------------------------------------------------------------------------------------
def test_amp301_fires_when_the_model_got_new_parameters_after_the_optimizer_was_built():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    # assign=True replaces the Parameter objects: the optimizer keeps stepping the old fp32 ones
    model.load_state_dict({k: v.half() for k, v in model.state_dict().items()}, assign=True)
    findings = list(optimizer_tensors_not_in_model(TrainingSetup(model, opt)))

    assert [(f.code, f.where) for f in findings] == [("AMP301", "optimizer[0] group 0")]
    detail = findings[0].detail
    assert "4 of 4 tensors" in detail
    assert "params[0] (float32, [10, 10], cpu)" in detail
    assert "the model has 0.weight with the same shape, but dtype float16" in detail


def test_amp301_says_when_no_model_parameter_has_the_shape():
    model = mlp()
    other = nn.Sequential(nn.Linear(7, 3))   # the optimizer of another model: none of its tensors is the model's
    opt = torch.optim.SGD([{"params": other[0].weight}, {"params": other[0].bias}], lr=0.1)
    findings = list(optimizer_tensors_not_in_model(TrainingSetup(model, opt)))

    assert [f.where for f in findings] == ["optimizer[0] group 0", "optimizer[0] group 1"]
    assert "params[0] (float32, [3, 7], cpu)" in findings[0].detail
    assert "no model parameter has this shape" in findings[0].detail


# A parameter trained next to the model but kept outside it (CLIP's logit scale, a temperature, learned loss weights)
# was a false AMP301 error ("Was the optimizer built before .to()/.half()...?"): every trainable parameter of the
# model is stepped, so it stands for none of them.
@pytest.mark.parametrize("shape", [(), (4,), (10,)], ids=["scalar", "vector", "shape-of-a-held-bias"])
@pytest.mark.parametrize("grouping", ["same-group", "own-group"])
def test_amp301_quiet_for_a_free_standing_parameter_next_to_the_model(shape, grouping):
    model = mlp()
    free = nn.Parameter(torch.ones(shape))
    groups = [*model.parameters(), free] if grouping == "same-group" else \
        [{"params": model.parameters()}, {"params": [free], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    setup = TrainingSetup(model, opt, torch.amp.GradScaler("cpu"), torch.float16)

    assert list(optimizer_tensors_not_in_model(setup)) == []
    assert list(params_missing_from_optimizer(setup)) == []


def test_amp301_quiet_for_an_optimizer_of_its_own_over_a_free_standing_parameter():
    # SAC's entropy coefficient: log_alpha has an optimizer of its own; the model's are all in the other one
    model = mlp()
    log_alpha = nn.Parameter(torch.zeros(1))
    opts = [torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW([log_alpha], lr=3e-4)]
    assert list(optimizer_tensors_not_in_model(TrainingSetup(model, opts))) == []


def test_amp301_names_a_stale_copy_next_to_a_free_standing_parameter():
    # the head was re-created after the optimizer was built: its old tensors stand for the new head's, in no optimizer
    model = mlp()
    scale = nn.Parameter(torch.ones(()))
    opt = torch.optim.AdamW([*model.parameters(), scale], lr=1e-3)
    model[2] = nn.Linear(10, 4)
    setup = TrainingSetup(model, opt)
    (finding,) = optimizer_tensors_not_in_model(setup)

    assert finding.where == "optimizer[0] group 0"
    assert "2 of 5 tensors" in finding.detail and "params[2] (float32, [4, 10], cpu)" in finding.detail
    assert "params[4]" not in finding.detail   # the logit scale stands for nothing
    assert [f.where for f in params_missing_from_optimizer(setup)] == ["2"]


def test_amp301_names_a_flat_stale_copy_next_to_the_models_parameters():
    model = mlp()
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in model[2].parameters()]))   # 44 entries
    opt = torch.optim.SGD([*model[0].parameters(), flat], lr=0.1)
    (finding,) = optimizer_tensors_not_in_model(TrainingSetup(model, opt))
    assert "1 of 3 tensors" in finding.detail and "params[2] (float32, [44], cpu)" in finding.detail


def test_amp301_keeps_an_optimizer_of_other_tensors_only_when_the_model_trains_nowhere():
    # all foreign and the model in no optimizer: the wrong model, or the optimizer built before it was re-created
    model = mlp()
    opt = torch.optim.AdamW([nn.Parameter(torch.ones(())), nn.Parameter(torch.ones(3))], lr=1e-3)
    setup = TrainingSetup(model, opt)
    assert [f.code for f in optimizer_tensors_not_in_model(setup)] == ["AMP301"]
    assert "see AMP301" in " ".join(f.detail for f in params_missing_from_optimizer(setup))


def test_amp301_prefers_a_same_shape_twin_that_no_optimizer_holds():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stray = nn.Parameter(torch.zeros(4, 4))
    opt = torch.optim.SGD([model[0].weight, model[0].bias, model[1].bias, stray], lr=0.1)
    (finding,) = optimizer_tensors_not_in_model(TrainingSetup(model, opt))
    assert "the model has 1.weight with the same shape" in finding.detail


def test_amp301_quiet_when_the_optimizer_is_built_after_the_model_is_ready():
    model = mlp().half()
    opt = torch.optim.AdamW(model.parameters())
    assert list(optimizer_tensors_not_in_model(TrainingSetup(model, opt))) == []


def test_amp301_quiet_without_a_model():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    assert list(optimizer_tensors_not_in_model(TrainingSetup(optimizers=opt))) == []


# ---- AMP302 -----------------------------------------------------------------------------------------------------
def test_amp302_names_trainable_parameters_no_optimizer_steps():
    model = mlp()
    opt = torch.optim.AdamW(model[0].parameters())
    findings = list(params_missing_from_optimizer(TrainingSetup(model, opt)))

    assert [(f.code, f.where) for f in findings] == [("AMP302", "2")]
    assert "2.weight (float32, [4, 10])" in findings[0].detail and "0.weight" not in findings[0].detail
    assert "2 of 4 trainable parameters" in findings[0].detail


def test_amp302_quiet_for_frozen_parameters_left_out_of_the_optimizer():
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert list(params_missing_from_optimizer(TrainingSetup(model, opt))) == []


def test_amp302_quiet_without_an_optimizer():
    assert list(params_missing_from_optimizer(TrainingSetup(mlp()))) == []


# ---- tensors trained by the script's own wiring (hand-written fp32 master copies) -------------------------------
def _masters(flat: bool = False):
    model = mlp().half()
    copies = [p.detach().float().reshape(-1) for p in model.parameters()]
    main = [torch.cat(copies).requires_grad_(True)] if flat else \
        [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    return model, main, torch.optim.AdamW(main)


def test_before_any_gradient_master_copies_look_stale():
    model, _, opt = _masters()
    setup = TrainingSetup(model, opt)
    assert [f.code for f in optimizer_tensors_not_in_model(setup)] == ["AMP301"]
    assert {f.code for f in params_missing_from_optimizer(setup)} == {"AMP302"}


@pytest.mark.parametrize("flat", [False, True], ids=["per-parameter", "flat"])
def test_master_copies_with_gradients_are_no_amp301_and_stand_in_for_the_model(flat):
    model, main, opt = _masters(flat)
    for t in main:
        t.grad = torch.zeros_like(t)
    setup = TrainingSetup(model, opt)
    assert list(optimizer_tensors_not_in_model(setup)) == []
    assert list(params_missing_from_optimizer(setup)) == []


def test_copies_stand_in_only_for_parameters_of_their_shapes():
    model = mlp().half()
    copy = model[0].weight.detach().float().requires_grad_(True)  # a copy of 0.weight only
    copy.grad = torch.zeros_like(copy)
    setup = TrainingSetup(model, torch.optim.SGD([copy], lr=0.1))
    missing = list(params_missing_from_optimizer(setup))
    assert [f.where for f in missing] == ["0", "2"]  # 0.bias and both of layer 2's are still in no optimizer


def test_confirm_wiring_keeps_only_what_still_holds():
    model, main, opt = _masters()
    setup = TrainingSetup(model, opt)
    report = Report([*optimizer_tensors_not_in_model(setup), *params_missing_from_optimizer(setup),
                     Finding("AMP101", Severity.ERROR, "0", "kept")])
    confirm_wiring(report, setup)  # no gradient yet: all of it still holds
    assert [f.code for f in report.findings] == ["AMP301", "AMP302", "AMP302", "AMP101"]
    for t in main:
        t.grad = torch.zeros_like(t)
    confirm_wiring(report, setup)
    assert [f.code for f in report.findings] == ["AMP101"]


@pytest.mark.parametrize("held", ["stale", "frozen", "none"])
def test_amp302_points_to_amp301_only_when_amp301_names_stale_tensors(held):
    # the frozen case is accelerate issue 328 (tests/real/cases/d07): the optimizer got the frozen backbone
    model = nn.ModuleDict({"backbone": nn.Linear(4, 4), "head": nn.Linear(4, 2)})
    model["backbone"].requires_grad_(False)
    tensors = {"stale": list(nn.Linear(4, 2).parameters()), "frozen": list(model["backbone"].parameters()),
               "none": []}[held]
    opt = torch.optim.SGD(tensors or [nn.Parameter(torch.zeros(1))], lr=0.1)
    if not tensors:
        opt.param_groups[0]["params"] = []
    setup = TrainingSetup(model, opt)
    summary = " ".join(f.detail for f in params_missing_from_optimizer(setup))
    assert "None of the 2 trainable parameters is in an optimizer" in summary, summary
    assert ("see AMP301" in summary) == (held == "stale"), summary
    assert bool(list(optimizer_tensors_not_in_model(setup))) == (held == "stale")
    assert {"stale": "another model", "frozen": "requires_grad=False", "none": "no tensor at all"}[held] in summary
