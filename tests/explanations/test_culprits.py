"""AMP406 culprits on real setups: an optimizer over a frozen adapter, one over no parameters at all, and one over a
free-standing parameter."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from ampdoctor.core.training import TrainingSetup
from ampdoctor.explanations.crash import explain_exception

peft = pytest.importorskip("peft")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x))


def no_inf_checks(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> BaseException:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer") as info:
        scaler.step(opt)
    return info.value


def test_an_optimizer_over_a_frozen_adapter_says_none_requires_grad():
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, target_modules=["proj"], modules_to_save=["head"])
    model = peft.get_peft_model(Net(), config)
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["proj"]))   # added frozen: "default" trains
    frozen = [p for n, p in model.named_parameters() if ".other." in n]
    assert len(frozen) == 2 and not any(p.requires_grad for p in frozen)
    opt = torch.optim.AdamW(frozen)
    scaler = torch.amp.GradScaler("cpu")
    findings = explain_exception(no_inf_checks(model, opt, scaler), TrainingSetup(model, opt, scaler))
    assert {f.code for f in findings} == {"AMP406"}
    assert {f.where for f in findings} == {"base_model.model.proj.lora_A.other", "base_model.model.proj.lora_B.other"}
    assert all("optimizer[0] (AdamW) holds 2 parameters, none of which requires grad" in f.detail
               for f in findings)


def test_an_optimizer_with_a_trainable_but_unused_param_does_not_say_none():
    model = Net()
    model.aux = nn.Linear(8, 8)   # trainable, never called in forward
    model.head.requires_grad_(False)
    opt = torch.optim.SGD([*model.head.parameters(), *model.aux.parameters()], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    findings = explain_exception(no_inf_checks(model, opt, scaler), TrainingSetup(model, opt, scaler))
    assert {f.code for f in findings} == {"AMP406"}
    assert any("head.weight, head.bias: frozen" in f.detail for f in findings)
    assert not any("none of which requires grad" in f.detail for f in findings)


def test_an_optimizer_over_no_parameters_says_so():
    model = Net()
    opt = torch.optim.SGD([{"params": [p for p in model.parameters() if not p.requires_grad]}], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    findings = explain_exception(no_inf_checks(model, opt, scaler), TrainingSetup(model, opt, scaler))
    assert [f.code for f in findings] == ["AMP406"]
    assert findings[0].where == "optimizer[0] (SGD)"
    assert re.search(r"holds no parameters", findings[0].detail)


def test_a_free_standing_parameter_the_loss_did_not_use_is_no_stale_tensor():
    """Was a false AMP301 (and an AMP406 saying the optimizer was built over different tensors): a temperature with an
    optimizer of its own, left out of this step's loss, stands for no parameter of the model, all of which train."""
    model = Net()
    temperature = nn.Parameter(torch.ones(()))
    opts = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD([temperature], lr=0.1)]
    scaler = torch.amp.GradScaler("cpu")
    findings = explain_exception(no_inf_checks(model, opts[1], scaler), TrainingSetup(model, opts, scaler))
    assert [(f.code, f.where) for f in findings] == [("AMP406", "optimizer[1] (SGD)")]
    assert "param_groups[0]['params'][0] (float32, [])" in findings[0].detail
    assert "not used in the forward pass" in findings[0].detail
