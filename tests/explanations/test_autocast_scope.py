"""AMP501's autocast scope (explanations/autocast_scope.py): a ``with NAME:`` block counts when NAME was assigned an
autocast call in the same function, the way diffusers' ``log_validation`` builds ``autocast_ctx``."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ampdoctor.core.training import TrainingSetup
from ampdoctor.explanations.crash import explain_exception


class Denoiser(nn.Module):
    """A pipeline-like model: a projection and a LayerNorm, loaded in fp16 (CPU autocast leaves layer_norm alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def log_validation(pipeline: nn.Module, accelerator: SimpleNamespace, mps: bool = False) -> list[torch.Tensor]:
    """Run validation the way diffusers' training examples do: the autocast context is built first, entered later."""
    if mps:
        autocast_ctx = nullcontext()
    else:
        autocast_ctx = torch.autocast(accelerator.device.type)
    images = []
    for _ in range(2):
        with autocast_ctx:
            images.append(pipeline(torch.randn(2, 8)))
    return images


def log_validation_inline(pipeline: nn.Module, device_type: str, mps: bool) -> torch.Tensor:
    autocast_ctx = nullcontext() if mps else torch.autocast(device_type)
    with autocast_ctx:
        return pipeline(torch.randn(2, 8))


def crash_of(fn, *args) -> BaseException:
    with pytest.raises(RuntimeError) as info:
        fn(*args)
    return info.value


def test_an_autocast_context_entered_through_a_variable_counts_as_inside_autocast():
    pipeline = Denoiser().half()
    accelerator = SimpleNamespace(device=torch.device("cpu"))
    findings = explain_exception(crash_of(log_validation, pipeline, accelerator), TrainingSetup(pipeline))
    assert [f.code for f in findings] == ["AMP501"]
    f = findings[0]
    assert f.where == "norm (LayerNorm)"
    assert "inside torch.autocast(accelerator.device.type) (as autocast_ctx) at test_autocast_scope.py:" in f.detail
    assert "no torch.autocast block was seen" not in f.detail
    assert "CPU autocast does not cast layer_norm" in f.detail


def test_the_conditional_expression_form_counts_too():
    detail = explain_exception(crash_of(log_validation_inline, Denoiser().half(), "cpu", False))[0].detail
    assert "inside torch.autocast(device_type) (as autocast_ctx)" in detail


def test_the_nullcontext_branch_is_not_autocast():
    # The frame's autocast_ctx is the nullcontext() that ran: no autocast, whatever the other branch assigns.
    detail = explain_exception(crash_of(log_validation_inline, Denoiser().half(), "cpu", True))[0].detail
    assert "no torch.autocast block was seen" in detail and "autocast_ctx" not in detail


def run_with_other_context(model: nn.Module) -> torch.Tensor:
    ctx = torch.no_grad()   # a context variable that is no autocast
    with ctx:
        return model(torch.randn(2, 8))


def test_a_context_variable_assigned_from_something_else_is_not_autocast():
    detail = explain_exception(crash_of(run_with_other_context, Denoiser().half()))[0].detail
    assert "no torch.autocast block was seen" in detail


def disabled_in_variable(model: nn.Module) -> torch.Tensor:
    autocast_ctx = torch.autocast("cpu", enabled=False)
    with autocast_ctx:
        return model(torch.randn(2, 8))


def test_a_disabled_autocast_in_a_variable_is_not_autocast():
    detail = explain_exception(crash_of(disabled_in_variable, Denoiser().half()))[0].detail
    assert "no torch.autocast block was seen" in detail
