"""Observers installed when the script imports an optional package (``core.patch.ImportHandle``), and what they
see: Lightning's Trainer and Fabric, built with ``precision="16-mixed"`` on a CPU, set up ``bf16-mixed`` (AMP213)."""

from __future__ import annotations

import sys

import pytest
from torch import nn

from ampdoctor.core.patch import ImportHandle
from ampdoctor.core.training import TrainingSetup
from ampdoctor.preflight.rules.config import lightning_fp16_became_bf16
from ampdoctor.runner.discovery import scaler_classes
from ampdoctor.session.observers import GlobalObservers


def test_an_import_handle_fires_once_the_module_is_imported_and_removes_what_it_installed(tmp_path, monkeypatch):
    (tmp_path / "late_module.py").write_text("class Thing:\n    def __init__(self, x):\n        self.x = x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []

    class Removable:
        def remove(self) -> None:
            seen.append(-1)

    handle = ImportHandle("late_module", lambda: [seen.append(1) or Removable()])
    assert seen == [] and handle in sys.meta_path   # not imported yet: waiting
    import late_module  # noqa: F401  (the import itself is the test)
    assert seen == [1] and handle not in sys.meta_path
    handle.remove()
    assert seen == [1, -1]
    sys.modules.pop("late_module")


@pytest.fixture
def facts():
    """The process-wide observers as `ampdoctor run` installs them, and the facts they record."""
    observers = GlobalObservers(type("Sink", (), {"__getattr__": lambda self, name: lambda *a, **k: None})(),
                                on_error=lambda exc: (_ for _ in ()).throw(exc))
    handles = observers.attach(scaler_classes())
    yield observers.facts
    for handle in reversed(handles):
        handle.remove()


def _amp213(facts) -> list[str]:
    return [f.detail for f in lightning_fp16_became_bf16(TrainingSetup(nn.Linear(2, 2), facts=facts))]


@pytest.mark.filterwarnings("ignore:You passed")
def test_fabric_16_mixed_on_a_cpu_is_said_to_run_bf16(facts):
    lightning = pytest.importorskip("lightning")
    lightning.Fabric(accelerator="cpu", devices=1, precision="16-mixed")
    (detail,) = _amp213(facts)
    assert detail.startswith("Fabric(precision='16-mixed') set up precision='bf16-mixed'")


@pytest.mark.filterwarnings("ignore:You passed")
def test_trainer_16_mixed_on_a_cpu_is_said_to_run_bf16(facts):
    lightning = pytest.importorskip("lightning")
    lightning.Trainer(accelerator="cpu", devices=1, precision="16-mixed", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    (detail,) = _amp213(facts)
    assert detail.startswith("Trainer(precision='16-mixed') set up precision='bf16-mixed'")


def test_bf16_asked_is_bf16_got_and_nothing_is_said(facts):
    lightning = pytest.importorskip("lightning")
    lightning.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    lightning.Fabric(accelerator="cpu", devices=1, precision="32-true")
    assert _amp213(facts) == []
