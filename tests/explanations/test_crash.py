"""Real CPU crashes explained from the catalog: codes, and the parameters or modules they name."""

from __future__ import annotations

import copy
import os
import pickle
import random
import re

import pytest
import torch
from torch import nn

from ampdoctor.core.training import TrainingSetup
from ampdoctor.explanations.crash import explain, explain_exception, explain_text, match_rules


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def scaled_backward(model: nn.Module, scaler: torch.amp.GradScaler) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()


def raised(fn, *args, **kwargs) -> BaseException:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever torch raised
        return exc
    raise AssertionError(f"{fn!r} did not raise")


def codes(findings) -> list[str]:
    return sorted({f.code for f in findings})


def named(findings, setup: TrainingSetup) -> set[str]:
    """Return the setup's parameter names that the findings mention."""
    text = " ".join(f"{f.where} {f.detail}" for f in findings)
    return {p.name for p in setup.params if re.search(rf"(?<![\w.]){re.escape(p.name)}(?![\w])", text)}


# ---- group A / C: parameter dtypes ---------------------------------------------------------------------------

def test_fp16_unscale_names_exactly_the_half_params():
    model = mlp()
    model[0].half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)
    exc = raised(scaler.unscale_, opt)
    assert str(exc) == "Attempting to unscale FP16 gradients."
    setup = TrainingSetup(model, opt)   # no scaler given: explain finds it in the traceback
    findings = explain_exception(exc, setup)
    assert codes(findings) == ["AMP101"]
    assert named(findings, setup) == {"0.weight", "0.bias"}


def test_fp16_unscale_without_setup_guesses_the_model_from_the_traceback():
    model = mlp()
    model[2].half()
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)
    exc = raised(scaler.step, opt)   # step's own unscale_ raises
    findings = explain_exception(exc)
    assert codes(findings) == ["AMP101"]
    assert named(findings, TrainingSetup(model)) == {"2.weight", "2.bias"}


def test_bf16_kernel_error_text_is_amp102():
    text = ('Traceback (most recent call last):\n  File "train.py", line 80, in <module>\n'
            '    scaler.step(optimizer)\nNotImplementedError: "_amp_foreach_non_finite_check_and_unscale_cuda" '
            "not implemented for 'BFloat16'")
    assert [r.code for r in explain_text(text)] == ["AMP102"]


# ---- group D: the GradScaler state machine, without a guard --------------------------------------------------

def test_unscale_twice_without_guard_offers_both_causes():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)
    scaler.unscale_(opt)
    scaled_backward(model, scaler)
    exc = raised(scaler.unscale_, opt)
    findings = explain_exception(exc, TrainingSetup(model, opt, scaler))
    assert codes(findings) == ["AMP401", "AMP402"]
    assert all("optimizer[0] (SGD)" in f.where for f in findings)
    assert all("ScalerGuard" in f.detail for f in findings)


def test_unscale_after_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)
    scaler.step(opt)
    exc = raised(scaler.unscale_, opt)
    findings = explain_exception(exc, TrainingSetup(model, opt, scaler))
    assert codes(findings) == ["AMP403"]
    assert "optimizer[0]" in findings[0].where


def test_step_twice_says_update_was_not_called_between():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):   # the loop forgot scaler.update()
        scaled_backward(model, scaler)
        try:
            scaler.step(opt)
        except RuntimeError as exc:
            findings = explain_exception(exc, TrainingSetup(model, opt, scaler))
    assert codes(findings) == ["AMP404"]
    assert findings[0].where == "optimizer[0] (SGD)"
    assert "no update() completed between the two steps" in findings[0].detail
    assert "scaler.update() after every scaler.step()" in findings[0].detail


def test_no_inf_checks_names_frozen_params():
    model = mlp()
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model[2].requires_grad_(False)   # the only params the optimizer holds are frozen
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)
    exc = raised(scaler.step, opt)
    assert "No inf checks were recorded for this optimizer" in str(exc)
    setup = TrainingSetup(model, opt, scaler)
    findings = explain_exception(exc, setup)
    assert codes(findings) == ["AMP406"]
    assert named(findings, setup) == {"2.weight", "2.bias"}
    assert "frozen" in findings[0].detail


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 1)   # never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_no_inf_checks_names_unused_params():
    model = TwoHeads()
    opt = torch.optim.SGD(model.aux.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)
    exc = raised(scaler.step, opt)
    setup = TrainingSetup(model, opt, scaler)
    findings = explain_exception(exc, setup)
    assert codes(findings) == ["AMP406"]
    assert named(findings, setup) == {"aux.weight", "aux.bias"}
    assert "not used in the forward pass" in findings[0].detail


def test_no_inf_checks_names_an_optimizer_over_other_tensors():
    model = mlp()
    opt = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1)   # built over a copy
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)
    exc = raised(scaler.step, opt)
    findings = explain_exception(exc, TrainingSetup(model, opt, scaler))
    assert codes(findings) == ["AMP301", "AMP406"]
    assert all("not parameters of the model" in f.detail for f in findings)
    no_grad = next(f for f in findings if f.code == "AMP406")
    assert "param_groups[0]['params'][0]" in no_grad.detail


def test_no_inf_checks_prior_to_update():
    model = mlp()
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)
    exc = raised(scaler.update)
    assert codes(explain_exception(exc)) == ["AMP407"]


def test_scale_is_none_when_backward_ran_on_the_unscaled_loss():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    model(torch.randn(4, 8)).sum().backward()   # forgot scaler.scale(loss)
    exc = raised(scaler.unscale_, opt)
    assert "_scale is None" in str(exc)
    findings = explain_exception(exc, TrainingSetup(model, opt, scaler))
    assert codes(findings) == ["AMP405"]
    assert "unscale_" in findings[0].detail and "optimizer[0]" in findings[0].where


def test_closure_with_scaler_lbfgs():
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).sum()
        scaler.scale(loss).backward()
        return loss

    exc = raised(scaler.step, opt, closure=closure)
    findings = explain_exception(exc, TrainingSetup(model, opt, scaler))
    assert codes(findings) == ["AMP204"]
    assert "LBFGS" in findings[0].where + findings[0].detail


def test_load_empty_scaler_state():
    scaler = torch.amp.GradScaler("cpu")
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    exc = raised(scaler.load_state_dict, disabled.state_dict())
    findings = explain_exception(exc)
    assert codes(findings) == ["AMP410"]
    assert findings[0].where == "GradScaler"


def test_pickling_a_scaler_mid_iteration():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaled_backward(model, scaler)
    scaler.step(opt)
    exc = raised(pickle.dumps, scaler)
    assert codes(explain_exception(exc)) == ["AMP410"]


# ---- group E: non-finite gradient norm -----------------------------------------------------------------------

def test_nonfinite_total_norm_names_the_parameter():
    model = mlp()
    model(torch.randn(4, 8)).sum().backward()
    model[2].weight.grad[0, 0] = float("inf")
    exc = raised(nn.utils.clip_grad_norm_, model.parameters(), 1.0, error_if_nonfinite=True)
    setup = TrainingSetup(model)
    findings = explain_exception(exc, setup)
    assert codes(findings) == ["AMP608"]
    assert named(findings, setup) == {"2.weight"}


# ---- group F: half/float mismatches --------------------------------------------------------------------------

class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.encoder = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(x))


def test_half_linear_with_float_input_names_the_module():
    model = Encoder()
    model.encoder.half()
    exc = raised(model, torch.randn(2, 8))
    findings = explain_exception(exc, TrainingSetup(model))
    assert codes(findings) == ["AMP501"]
    f = findings[0]
    assert f.where == "encoder (Linear)"
    assert "weight float16" in f.detail and "input float32 [2, 8]" in f.detail
    assert "no torch.autocast block was seen" in f.detail and "x.to(torch.float16)" in f.detail


class Block(nn.Module):
    """A transformer-like block: a projection and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def test_fp16_model_under_cpu_bf16_autocast_is_explained_inside_autocast():
    model = Block().half()   # an fp16 checkpoint trained with bf16=True on CPU
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=re.escape("mixed dtype (CPU): expect parameter to have scalar type "
                                                         "of Float")) as info:
            model(torch.randn(2, 8))
    findings = explain_exception(info.value, TrainingSetup(model))
    assert codes(findings) == ["AMP501"]
    f = findings[0]
    assert f.where == "norm (LayerNorm)"
    assert "weight float16" in f.detail and "input bfloat16 [2, 8]" in f.detail
    assert "inside torch.autocast('cpu', dtype=torch.bfloat16) at test_crash.py:" in f.detail
    assert "CPU autocast does not cast layer_norm" in f.detail
    assert "keep the parameters fp32 (model.float()" in f.detail
    assert "no torch.autocast block" not in f.detail and "outside" not in f.detail
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.float()(torch.randn(2, 8))   # the fix it gives works


def test_fp16_layer_norm_without_autocast_gets_the_cpu_norm_reason():
    norm = nn.LayerNorm(8).half()
    exc = raised(norm, torch.randn(2, 8))
    findings = explain_exception(exc)
    assert codes(findings) == ["AMP501"]
    assert "half parameters only with an input of their own dtype" in findings[0].detail
    assert "CPU autocast" not in findings[0].detail   # nothing says it ran under autocast


def test_an_autocast_decorator_on_forward_counts_as_inside_autocast():
    model = Block().half()
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)   # what accelerate does
    findings = explain_exception(raised(model, torch.randn(2, 8)), TrainingSetup(model))
    assert codes(findings) == ["AMP501"]
    assert "torch.autocast('cpu', dtype=torch.bfloat16) decorator" in findings[0].detail


def test_a_disabled_autocast_block_is_not_inside_autocast():
    model = Encoder()
    model.encoder.half()
    with torch.autocast("cpu", enabled=False):
        with pytest.raises(RuntimeError) as info:
            model(torch.randn(2, 8))
    assert "no torch.autocast block was seen" in explain_exception(info.value)[0].detail


def test_half_conv_names_the_module_without_a_setup():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    net[2].half()
    exc = raised(net, torch.randn(1, 3, 8, 8))
    assert "should be the same" in str(exc)
    findings = explain_exception(exc)   # the model is found in this frame's locals
    assert codes(findings) == ["AMP501"]
    assert findings[0].where == "2 (Conv2d)"
    assert "float16" in findings[0].detail and "input float32 [1, 4, 6, 6]" in findings[0].detail


def test_half_matmul_outside_modules_names_the_call_site():
    a, b = torch.randn(2, 3, 4).half(), torch.randn(2, 4, 5)
    exc = raised(torch.bmm, a, b)
    findings = explain_exception(exc)
    assert codes(findings) == ["AMP501"]
    assert findings[0].where.startswith("test_crash.py:")


def test_a_wrapped_error_is_explained_through_its_cause():
    scaler = torch.amp.GradScaler("cpu")

    def resume() -> None:
        try:
            scaler.load_state_dict({})
        except RuntimeError as exc:
            raise RuntimeError("could not resume from checkpoint") from exc

    assert codes(explain_exception(raised(resume))) == ["AMP410"]


# ---- the exception is data, never changed --------------------------------------------------------------------

def test_exception_is_left_untouched_and_unrelated_errors_give_nothing():
    exc = raised(lambda: {}["missing"])
    tb, args = exc.__traceback__, exc.args
    assert explain_exception(exc) == []
    assert exc.__traceback__ is tb and exc.args == args and exc.__cause__ is None


def test_explain_dispatches_on_type():
    assert [r.code for r in explain("AMP404")] == ["AMP404"]
    exc = raised(torch.amp.GradScaler("cpu").load_state_dict, {})
    assert [f.code for f in explain(exc)] == ["AMP410"]
    with pytest.raises(TypeError):
        explain(42)  # type: ignore[arg-type]


# ---- explain_text ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("AMP101", ["AMP101"]),
    ("amp405", ["AMP405"]),
    ("fp16-trainable-params", ["AMP101"]),
    ("AMP401, AMP402", ["AMP401", "AMP402"]),
    ("RuntimeError: unscale_() has already been called on this optimizer since the last update().",
     ["AMP401", "AMP402"]),
    ("RuntimeError: unscale_() is being called after step().", ["AMP403"]),
    ("AssertionError: No inf checks were recorded for this optimizer.", ["AMP406"]),
    ("AssertionError: Attempted step but _scale is None.  This may indicate your script did not use "
     "scaler.scale(loss or outputs) earlier in the iteration.", ["AMP405"]),
    ("RuntimeError: Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should be the same",
     ["AMP501"]),
    ("2024-01-01 12:00:00 [INFO] Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
     ["AMP603"]),
    ("UserWarning: Detected call of `lr_scheduler.step()` before `optimizer.step()`. In PyTorch 1.1.0", ["AMP409"]),
    ("all good, loss=0.12", []),
    ("", []),
    ("AMP999", []),
])
def test_explain_text(text, expected):
    assert [r.code for r in explain_text(text)] == expected


def test_explain_text_reads_the_tail_of_a_long_log():
    log = "step 1 loss 0.5\n" * 20_000 + "ValueError: Attempting to unscale FP16 gradients.\n"
    assert [r.code for r in explain_text(log)] == ["AMP101"]


@pytest.mark.parametrize("make", [
    lambda: "".join(random.Random(0).choices("abcdef \n()[].*expected dtype", k=1_000_000)),
    lambda: random.Random(1).randbytes(300_000).decode("latin-1"),
    lambda: os.urandom(300_000).decode("utf-8", "replace"),
    lambda: "expected dtype " * 100_000,                        # `expected .*dtype.* to match` never matches
    lambda: " to match" + "expected dtype " * 100_000,
    lambda: "loss scale " * 100_000,                            # `loss scale.*(minimum|collapsed)`
    lambda: "OVERFLOW! " * 100_000 + "\n" * 50_000,
    lambda: "Input type (" + "x" * 500_000,
    lambda: "İ" * 300_000 + "ValueError: Attempting to unscale FP16 gradients.",
])
def test_explain_text_survives_hostile_input(make):
    # Speed on such input is shown by the linear patterns (bounded quantifiers) and the 200 KB tail, not timed here.
    result = explain_text(make())
    assert isinstance(result, list)


def test_match_rules_keeps_working_after_non_ascii_lowering():
    assert [r.code for r in match_rules("İ" * 10 + " mat1 and mat2 must have the same dtype")] == ["AMP501"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_params_under_an_fp16_scaler_on_cuda():
    model = nn.Sequential(nn.Linear(16, 16)).cuda().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)).float().sum()
    scaler.scale(loss).backward()
    try:
        scaler.step(opt)
    except (RuntimeError, NotImplementedError) as exc:
        setup = TrainingSetup(model, opt, scaler)
        findings = explain_exception(exc, setup)
        assert codes(findings) == ["AMP102"]
        assert named(findings, setup) == {"0.weight", "0.bias"}
    else:
        pytest.skip("this torch's CUDA unscale kernel accepts bfloat16")


def test_invalid_scaler_config_is_explained():
    with pytest.raises(AssertionError) as info:
        torch.amp.GradScaler("cpu", growth_factor=0.5)
    assert [f.code for f in explain_exception(info.value)] == ["AMP207"]


def test_missing_scaler_kernel_text_is_explained():
    text = ("RuntimeError: Could not run 'aten::_amp_foreach_non_finite_check_and_unscale_' with arguments from "
            "the 'SparseCUDA' backend.")
    assert [r.code for r in explain_text(text)] == ["AMP206"]


# ---- error texts from real reports that used to have no (or a wrong) explanation ---------------------------------
@pytest.mark.parametrize("text, code", [
    ('RuntimeError: "addmm_impl_cpu_" not implemented for \'Half\'', "AMP504"),
    ('RuntimeError: "LayerNormKernelImpl" not implemented for \'BFloat16\'', "AMP504"),   # not AMP102's scaler case
    ("RuntimeError: value cannot be converted to type at::Half without overflow", "AMP503"),
    ("RuntimeError: Found dtype Float but expected Half", "AMP501"),
    ("RuntimeError: torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.",
     "AMP502"),
    ("ValueError: fp16 mixed precision requires a GPU (not 'mps').", "AMP203"),
    ("RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float", "AMP501"),
])
def test_error_texts_of_public_reports_get_their_rule(text, code):
    assert [r.code for r in explain_text(text)] == [code]


def test_a_half_loss_against_a_float_target_is_amp501_on_the_real_error():
    out = torch.randn(3, requires_grad=True)
    exc = raised(lambda: nn.functional.huber_loss(out.half(), torch.randn(3)).backward())
    assert "Found dtype Float but expected Half" in str(exc)
    assert codes(explain_exception(exc)) == ["AMP501"]


def test_a_real_op_without_a_bf16_kernel_is_amp504_not_amp102():
    exc = raised(torch.linalg.cholesky_ex, torch.eye(2, dtype=torch.bfloat16))
    assert "not implemented for 'BFloat16'" in str(exc)
    assert codes(explain_exception(exc)) == ["AMP504"]
    assert [r.code for r in explain_text(f"{type(exc).__name__}: {exc}")] == ["AMP504"]


def test_the_real_scaler_unscale_kernel_text_stays_amp102():
    # torch 2.13's CPU unscale kernel accepts bfloat16, so the bf16 error is only raised on CUDA (see the cuda test
    # above); a complex parameter makes the real kernel raise the same message with another dtype name.
    model = nn.Linear(2, 2, dtype=torch.complex64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2, dtype=torch.complex64)).abs().sum()).backward()
    exc = raised(scaler.unscale_, opt)
    text = f"{type(exc).__name__}: {exc}"
    assert "_amp_foreach_non_finite_check_and_unscale_cpu\" not implemented for 'ComplexFloat'" in text
    assert [r.code for r in explain_text(text.replace("ComplexFloat", "BFloat16"))] == ["AMP102"]


def test_an_anomaly_mode_nan_is_a_backward_nonfinite():
    x = torch.zeros(3, requires_grad=True)
    with pytest.warns(UserWarning), torch.autograd.detect_anomaly():   # its own and "Error detected in"
        exc = raised(lambda: (x.sqrt() * 0).sum().backward())   # forward 0, backward 0/0
    assert "Function 'SqrtBackward0' returned nan values in its 0th output." in str(exc)
    assert codes(explain_exception(exc)) == ["AMP602"]
    assert [r.code for r in explain_text("RuntimeError: Function 'MmBackward0' returned nan values in its 0th "
                                         "output.")] == ["AMP602"]


def test_a_constant_that_overflows_fp16_is_explained_on_the_real_error():
    scores = torch.zeros(2, 3, dtype=torch.float16)
    exc = raised(scores.fill_, 1e5)   # torch 2.13: "value cannot be converted to type c10::Half without overflow"
    assert codes(explain_exception(exc)) == ["AMP503"]


def test_nonfinite_total_norm_over_several_modules_is_one_finding_naming_them():
    model = mlp()
    model(torch.randn(4, 8)).sum().backward()
    model[0].bias.grad[0] = float("nan")
    model[2].weight.grad[0, 0] = float("inf")
    exc = raised(nn.utils.clip_grad_norm_, model.parameters(), 1.0, error_if_nonfinite=True)
    [finding] = explain_exception(exc, TrainingSetup(model))
    assert (finding.code, finding.where) == ("AMP608", "2 modules (0, 2)")
    assert finding.detail.startswith("non-finite gradients: 0.bias, 2.weight;")


@pytest.mark.parametrize("given", [False, True], ids=["read-from-the-frames", "given"])
def test_models_local_to_a_function_are_named_as_its_frame_names_them(given):
    """Was ``Sequential[1].0``: a crash is explained after the script's module is gone (``ampdoctor run``) or in a
    function whose locals hold the models; their names come from the crash's frames, given setup or not."""
    G = mlp()
    D = nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 1)).half()
    opt = torch.optim.SGD([*G.parameters(), *D.parameters()], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = D(G(torch.randn(4, 8))).float().mean()
    scaler.scale(loss).backward()
    exc = raised(scaler.step, opt)
    findings = explain_exception(exc, TrainingSetup([G, D], opt, scaler) if given else None)
    assert [(f.code, f.where) for f in findings] == [("AMP101", "D.0"), ("AMP101", "D.2")]
    assert "D.0.weight (float16, [4, 1])" in findings[0].detail
