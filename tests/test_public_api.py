"""The public API survives importing every submodule, and building a monitor opens no CUDA context."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
from torch import nn

import ampdoctor


def _import_every_submodule() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(ampdoctor.__path__, "ampdoctor.") if m.name != "ampdoctor.__main__"]
    for name in names:
        importlib.import_module(name)
    return names


def test_explain_and_watch_work_after_every_submodule_is_imported():
    names = _import_every_submodule()
    assert "ampdoctor.explanations.crash" in names and "ampdoctor.monitor.watcher" in names
    rules = ampdoctor.explain("ValueError: Attempting to unscale FP16 gradients.")
    assert [r.code for r in rules] == ["AMP101"]
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, opt, every=1) as w:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert isinstance(w, ampdoctor.Watch)
    assert callable(ampdoctor.check) and callable(ampdoctor.fix)


@pytest.fixture
def cuda_init_sentinel(monkeypatch):
    """Pretend CUDA is available and record every attempt to initialise it (nothing here may)."""
    calls: list[str] = []

    def lazy_init() -> None:
        calls.append("torch.cuda._lazy_init")
        raise AssertionError("ampdoctor initialised CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lazy_init)
    return calls


def test_doctor_check_and_watch_leave_cuda_uninitialised(cuda_init_sentinel):
    from ampdoctor.core.options import RunOptions
    from ampdoctor.runner.doctor import Doctor

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doctor = Doctor(RunOptions(watch=False))
    report = ampdoctor.check(model, opt)
    with ampdoctor.watch(model, opt, every=1):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert cuda_init_sentinel == []
    assert doctor.report.environment.read is False and report.environment.read is False
    assert not torch.cuda.is_initialized()


def test_the_environment_is_read_when_shown_without_initialising_an_unused_cuda(cuda_init_sentinel):
    report = ampdoctor.check(nn.Linear(2, 2))
    shown = report.to_dict()["environment"]
    assert shown["cuda_available"] is True
    assert shown["device"].startswith("cpu (CUDA is available but this process did not use it)")
    assert cuda_init_sentinel == []
