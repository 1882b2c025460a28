"""AMP301–AMP302: optimizers that step other tensors than the model trains."""

import torch
from torch import nn

from ampdoctor.preflight.rules.wiring import optimizer_tensors_not_in_model, params_missing_from_optimizer
from ampdoctor.core.training import TrainingSetup


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
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [nn.Parameter(torch.zeros(7, 3))]}], lr=0.1)
    findings = list(optimizer_tensors_not_in_model(TrainingSetup(model, opt)))

    assert [f.where for f in findings] == ["optimizer[0] group 1"]
    assert "params[0] (float32, [7, 3], cpu)" in findings[0].detail
    assert "no model parameter has this shape" in findings[0].detail


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
