"""AMP203's fix is the switch of the framework that built the Accelerator, and its detail names the dtypes the
layers really compute in (a script may have cast its frozen weights to fp16 itself)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampdoctor.core.training import TrainingSetup
from ampdoctor.preflight.rules.config import accelerate_fp16_not_in_effect


@pytest.fixture
def fresh_state():
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the state is a process-wide singleton
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _amp203(model: nn.Module, accelerator) -> object:
    [finding] = accelerate_fp16_not_in_effect(TrainingSetup(model, accelerator=accelerator))
    return finding


def test_a_transformers_trainer_gets_training_arguments_bf16(fresh_state, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, fp16=True, report_to=[],
                                          save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args)
    finding = _amp203(model, trainer.accelerator)
    assert finding.fix is not None and finding.fix.startswith("args = TrainingArguments(..., bf16=True)")
    assert "Accelerator(" not in finding.fix
    assert "Trainer built for TrainingArguments(fp16=True)" in finding.detail


def test_a_script_of_its_own_gets_accelerator_bf16(fresh_state) -> None:
    from accelerate import Accelerator

    finding = _amp203(nn.Linear(4, 2), Accelerator(cpu=True, mixed_precision="fp16"))
    assert finding.fix is not None and finding.fix.startswith("accelerator = Accelerator(mixed_precision='bf16')")
    assert "the model trains in float32, not fp16 mixed precision" in finding.detail


def test_a_lightning_module_gets_trainer_precision(fresh_state) -> None:
    lightning = pytest.importorskip("lightning.pytorch")
    from accelerate import Accelerator

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 2)

    finding = _amp203(Module(), Accelerator(cpu=True, mixed_precision="fp16"))
    assert finding.fix is not None and finding.fix.startswith('trainer = Trainer(precision="bf16-mixed")')


def test_frozen_weights_cast_to_fp16_by_the_script_are_said_so(fresh_state) -> None:
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    model[0].half().requires_grad_(False)   # diffusers-style: weight_dtype = float16 for the frozen part
    finding = _amp203(model, Accelerator(cpu=True, mixed_precision="fp16"))
    assert "the trainable parameters are float32 and the frozen ones float16" in finding.detail
    assert "those with float16 weights in float16 and those with float32 weights in float32" in finding.detail
    assert "float32 for a float32 model" not in finding.detail
