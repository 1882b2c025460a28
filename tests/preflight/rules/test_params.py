"""AMP101–AMP105 on tiny real models, real optimizers and real GradScalers."""

import warnings

import pytest
import torch
from torch import nn

from ampdoctor.core.findings import Severity
from ampdoctor.core.grouping import group_findings
from ampdoctor.core.training import TrainingSetup
from ampdoctor.preflight.engine import check
from ampdoctor.preflight.rules.params import (
    adam_eps_underflow,
    bf16_params_under_fp16_amp,
    fp16_trainable_params,
    fused_optimizer_fp16_params,
    pure_half_without_master,
)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10))


def cpu_scaler(**kwargs) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kwargs)


def sharded_scaler() -> torch.amp.GradScaler:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler("cpu")


def where(findings) -> list[str]:
    return [f.where for f in findings]


@pytest.fixture
def master_weights():
    """Return ``ampdoctor.MasterWeights``'s constructor; detach every wrapper it made after the test."""
    import ampdoctor.repairs.master_weights as module
    made = []

    def wrap(optimizer):
        made.append(module.MasterWeights(optimizer))
        return made[-1]

    yield wrap
    for wrapper in made:
        try:
            wrapper.detach()  # removes its global forward hook
        except Exception as exc:  # not what these tests are about; say so without failing them
            warnings.warn(f"MasterWeights.detach() raised {exc!r}", stacklevel=1)


# ---- AMP101 -----------------------------------------------------------------------------------------------------
def test_amp101_names_each_stray_fp16_parameter_by_module():
    model = mlp()
    model[2].half()
    findings = list(fp16_trainable_params(TrainingSetup(model, scaler=cpu_scaler())))

    assert [f.code for f in findings] == ["AMP101"]
    assert findings[0].severity is Severity.ERROR
    assert findings[0].where == "2"
    assert "2.weight (float16, [10, 10])" in findings[0].detail and "2.bias (float16, [10])" in findings[0].detail
    assert "0.weight" not in findings[0].detail
    assert "2 of 4 trainable parameters are float16" in findings[0].detail
    assert "stray" in findings[0].detail


def test_amp101_says_when_the_whole_model_was_cast():
    model = mlp().half()
    findings = list(fp16_trainable_params(TrainingSetup(model, scaler=cpu_scaler())))

    assert where(findings) == ["0", "2"]
    assert all("All 4 trainable parameters are float16" in f.detail for f in findings)
    assert all("whole model was cast" in f.detail for f in findings)
    assert not any("stray" in f.detail for f in findings)


def test_amp101_says_most_of_the_model_was_cast_when_only_a_few_modules_kept_fp32():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.LayerNorm(10))
    model[:2].half()
    findings = list(fp16_trainable_params(TrainingSetup(model, scaler=cpu_scaler())))

    assert where(findings) == ["0", "1"]
    assert all("4 of 6 trainable parameters are float16: most of the model was cast" in f.detail for f in findings)


def test_amp101_blames_the_trainable_part_when_only_it_is_fp16_next_to_a_frozen_base():
    model = mlp().half()
    model[0].requires_grad_(False)
    findings = list(fp16_trainable_params(TrainingSetup(model, scaler=cpu_scaler())))

    assert where(findings) == ["2"]
    assert "All 2 trainable parameters are float16" in findings[0].detail
    assert "2 frozen parameters" in findings[0].detail


def test_amp101_reproduces_the_error_it_predicts():
    # The rule's claim, checked against this torch: an fp16 trainable parameter makes unscale_() raise.
    model = mlp()
    model[2].half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cpu_scaler()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 10)).float().sum()
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)
    assert list(fp16_trainable_params(TrainingSetup(model, opt, cpu_scaler())))


def test_amp101_names_every_module_once_and_they_share_one_cause():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(60)]).half()
    findings = list(fp16_trainable_params(TrainingSetup(model, scaler=cpu_scaler())))

    assert where(findings) == [str(i) for i in range(60)]  # all of them, for the JSON
    assert len({f.cause for f in findings}) == 1 and findings[0].cause in findings[0].detail
    groups = group_findings(findings)  # the console and the HTML page show them as one row
    assert len(groups) == 1 and groups[0].places == where(findings)
    assert groups[0].detail.startswith("Parameters in these 60 modules are trainable float16")


def test_amp101_lists_a_module_with_many_parameters_in_bounded_form():
    model = nn.ParameterList([nn.Parameter(torch.zeros(1, dtype=torch.float16)) for _ in range(1000)])
    (finding,) = fp16_trainable_params(TrainingSetup(model, scaler=cpu_scaler()))

    assert finding.where == "(root)"
    assert "and 990 more" in finding.detail
    assert len(finding.detail) < 1000


def test_amp101_names_a_free_standing_fp16_parameter_the_optimizer_steps_next_to_the_model():
    # a logit scale kept outside the model, created in fp16: the first unscale_() raises on it. Was AMP301 (a stale
    # copy from an optimizer built before .half()), and once AMP301 knew it is free-standing, nothing at all.
    model = mlp()
    scale = nn.Parameter(torch.ones((), dtype=torch.float16))
    opt = torch.optim.AdamW([{"params": model.parameters()}, {"params": [scale], "weight_decay": 0.0}], eps=1e-4)
    (finding,) = fp16_trainable_params(TrainingSetup(model, opt, cpu_scaler()))
    assert finding.where == "optimizer[0] group 1"
    # named where the optimizer holds it, as the watch and the explanations name it
    assert "param_groups[1]['params'][0] (float16, [])" in finding.detail
    assert "1 of 5 trainable parameters" in finding.detail
    assert check(model, opt, cpu_scaler()).codes() == ["AMP101"]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 10)).float().sum() * scale
    scaler = cpu_scaler()
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


def test_amp101_leaves_out_stale_fp16_copies_which_get_no_gradient():
    old = mlp().half()
    opt = torch.optim.SGD(old.parameters(), lr=0.1)   # then the model is re-created in fp32: AMP301, not AMP101
    assert check(mlp(), opt, cpu_scaler()).codes() == ["AMP301", "AMP302"]


@pytest.mark.parametrize("setup", [
    pytest.param(lambda: TrainingSetup(mlp(), scaler=cpu_scaler()), id="fp32 params"),
    pytest.param(lambda: TrainingSetup(mlp().half(), scaler=cpu_scaler(enabled=False)), id="disabled scaler"),
    pytest.param(lambda: TrainingSetup(mlp().half()), id="no scaler"),
    pytest.param(lambda: TrainingSetup(mlp().half(), scaler=sharded_scaler()), id="ShardedGradScaler allows fp16"),
    pytest.param(lambda: TrainingSetup(mlp().half().requires_grad_(False), scaler=cpu_scaler()), id="all frozen"),
])
def test_amp101_quiet(setup):
    assert list(fp16_trainable_params(setup())) == []


def test_amp101_quiet_for_a_frozen_fp16_base_with_fp32_adapters():
    base = mlp().half().requires_grad_(False)
    model = nn.ModuleDict({"base": base, "adapter": nn.Linear(10, 10)})
    assert list(fp16_trainable_params(TrainingSetup(model, scaler=cpu_scaler()))) == []


def test_amp101_quiet_when_master_weights_hold_fp32_copies(master_weights):
    model = mlp().half()
    opt = master_weights(torch.optim.AdamW(model.parameters()))
    assert list(fp16_trainable_params(TrainingSetup(model, opt, cpu_scaler()))) == []


# ---- AMP102 -----------------------------------------------------------------------------------------------------
def test_amp102_fires_for_bf16_params_under_an_fp16_scaler():
    model = mlp()
    model[0].to(torch.bfloat16)
    findings = list(bf16_params_under_fp16_amp(TrainingSetup(model, scaler=cpu_scaler())))

    assert [f.code for f in findings] == ["AMP102"]
    assert findings[0].where == "0"
    assert "0.weight (bfloat16, [10, 10])" in findings[0].detail
    assert "GradScaler('cpu') is enabled" in findings[0].detail


def test_amp102_fires_for_bf16_params_under_fp16_autocast_without_a_scaler():
    model = mlp().to(torch.bfloat16)
    findings = list(bf16_params_under_fp16_amp(TrainingSetup(model, autocast_dtype=torch.float16)))

    assert where(findings) == ["0", "2"]
    assert all("autocast runs in float16" in f.detail for f in findings)
    assert all("All 4 trainable parameters are bfloat16" in f.detail for f in findings)


def test_amp102_names_a_free_standing_bf16_parameter_and_agrees_with_its_count():
    # a bf16 logit scale kept outside an fp32 model, under fp16 autocast and a GradScaler: AMP102 said nothing
    model = mlp()
    scale = nn.Parameter(torch.ones((), dtype=torch.bfloat16))
    opt = torch.optim.AdamW([*model.parameters(), scale])
    (finding,) = bf16_params_under_fp16_amp(TrainingSetup(model, opt, cpu_scaler(), torch.float16))
    assert finding.where == "optimizer[0] group 0"
    assert "param_groups[0]['params'][4] (bfloat16, [])" in finding.detail
    assert "1 of 5 trainable parameters is bfloat16: stray casts" in finding.detail


def test_amp102_quiet_for_bf16_params_under_bf16_autocast_without_a_scaler():
    model = mlp().to(torch.bfloat16)
    assert list(bf16_params_under_fp16_amp(TrainingSetup(model, autocast_dtype=torch.bfloat16))) == []


def test_amp102_quiet_for_fp32_params_under_fp16_amp():
    setup = TrainingSetup(mlp(), scaler=cpu_scaler(), autocast_dtype=torch.float16)
    assert list(bf16_params_under_fp16_amp(setup)) == []


# ---- AMP103 -----------------------------------------------------------------------------------------------------
def test_amp103_fires_for_pure_bf16_training_and_names_the_optimizer_group():
    model = mlp().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    findings = list(pure_half_without_master(TrainingSetup(model, opt, autocast_dtype=torch.bfloat16)))

    assert [f.code for f in findings] == ["AMP103"]
    assert findings[0].severity is Severity.WARNING
    assert findings[0].where == "optimizer[0] group 0"
    assert "4 of 4 tensors" in findings[0].detail
    assert "0.weight (bfloat16, [10, 10])" in findings[0].detail and "lr=0.0001" in findings[0].detail


def test_amp103_at_a_warmup_start_names_the_base_lr_not_lr_0():
    # torchtune's and the Trainer's linear warmups start at lr 0; AMP103 is judged at the first step
    model = mlp().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 100)   # lr 0 at step 0
    assert opt.param_groups[0]["lr"] == 0
    (finding,) = pure_half_without_master(TrainingSetup(model, opt, autocast_dtype=torch.bfloat16))
    assert "AdamW (base lr=0.0003, 0 at this step) updates 4 of 4 tensors" in finding.detail, finding.detail
    assert "lr=0)" not in finding.detail


def test_amp103_fires_for_fp16_autocast_and_fp16_params_without_a_scaler():
    model = mlp().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    findings = list(pure_half_without_master(TrainingSetup(model, opt, autocast_dtype=torch.float16)))

    assert where(findings) == ["optimizer[0] group 0"]
    assert "float16" in findings[0].detail


def test_amp103_fires_under_a_sharded_scaler_which_lets_fp16_through():
    model = mlp().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert where(pure_half_without_master(TrainingSetup(model, opt, sharded_scaler()))) == ["optimizer[0] group 0"]


def test_amp103_without_an_optimizer_reports_the_model():
    findings = list(pure_half_without_master(TrainingSetup(mlp().to(torch.bfloat16))))
    assert where(findings) == ["model"]
    assert "4 of 4 trainable parameters" in findings[0].detail


def test_amp103_quiet_when_amp101_already_reports_fp16_params():
    model = mlp().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert list(pure_half_without_master(TrainingSetup(model, opt, cpu_scaler()))) == []


@pytest.mark.parametrize("pass_wrapper", [True, False], ids=["MasterWeights", "its inner optimizer"])
def test_amp103_quiet_with_master_weights(master_weights, pass_wrapper):
    model = mlp().to(torch.bfloat16)
    opt = master_weights(torch.optim.AdamW(model.parameters()))
    setup = TrainingSetup(model, opt if pass_wrapper else opt.optimizer, autocast_dtype=torch.bfloat16)
    assert list(pure_half_without_master(setup)) == []


def test_amp103_quiet_for_fp32_params():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    assert list(pure_half_without_master(TrainingSetup(model, opt, autocast_dtype=torch.bfloat16))) == []


# ---- AMP104 -----------------------------------------------------------------------------------------------------
class FairseqStyleAdam(torch.optim.Optimizer):
    """An Adam that steps half parameters in float32, as fairseq's own does (facebookresearch/fairseq
    fairseq/optim/adam.py at 3d262bb25690e4eb2e7d3c1309b1e9c406ca4b99, used by --memory-efficient-fp16): an fp32
    copy of the parameter, fp32 moments, eps added in fp32, the result copied back. Written for this test."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                wide, grad, state = p.float(), p.grad.float(), self.state[p]
                if not state:
                    state["step"], state["exp_avg"], state["exp_avg_sq"] = 0, torch.zeros_like(wide), \
                        torch.zeros_like(wide)
                state["step"] += 1
                state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                wide.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-group["lr"])
                p.copy_(wide)


def test_amp104_quiet_for_an_adam_that_adds_eps_in_fp32():
    # fairseq's --memory-efficient-fp16 trains a pure fp16 model with its own Adam: eps=1e-8 never meets fp16
    model = mlp().half()
    FairseqStyleAdam.__module__ = "fairseq.optim.adam"   # its class, by where it lives and its name
    FairseqStyleAdam.__name__ = "Adam"
    try:
        opt = FairseqStyleAdam(model.parameters())
        assert list(adam_eps_underflow(TrainingSetup(model, opt))) == []
    finally:
        FairseqStyleAdam.__module__, FairseqStyleAdam.__name__ = __name__, "FairseqStyleAdam"
    # any other Adam whose state shows fp32 moments for fp16 parameters, once it has stepped
    opt = FairseqStyleAdam(model.parameters())
    assert [f.code for f in adam_eps_underflow(TrainingSetup(model, opt))] == ["AMP104"]   # no state yet: unknown
    model(torch.randn(4, 10).half()).float().sum().backward()
    opt.step()
    assert list(adam_eps_underflow(TrainingSetup(model, opt))) == []
    assert [f.code for f in adam_eps_underflow(TrainingSetup(model, torch.optim.AdamW(model.parameters())))] \
        == ["AMP104"]


def test_amp104_fires_for_default_adam_eps_on_fp16_params():
    model = mlp()
    model[2].half()
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    findings = list(adam_eps_underflow(TrainingSetup(model, opt)))

    assert [f.code for f in findings] == ["AMP104"]
    assert findings[0].where == "optimizer[0] group 1"
    assert "eps=1e-08 is 0 in float16" in findings[0].detail
    assert "2.weight" in findings[0].detail and "5.96e-08" in findings[0].detail


def test_amp104_reproduces_the_nan_it_predicts():
    p = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.isnan(p).all()
    assert list(adam_eps_underflow(TrainingSetup(optimizers=opt)))


def test_amp104_says_when_eps_survives_only_as_the_smallest_subnormal():
    model = nn.Linear(4, 4).half()
    (finding,) = adam_eps_underflow(TrainingSetup(model, torch.optim.Adam(model.parameters(), eps=4e-8)))
    assert "rounds to 5.96e-08" in finding.detail


@pytest.mark.parametrize("dtype, kwargs", [
    pytest.param(torch.float16, {"eps": 1e-4}, id="fp16 with eps=1e-4"),
    pytest.param(torch.float32, {}, id="fp32 with eps=1e-8"),
    pytest.param(torch.bfloat16, {}, id="bf16 with eps=1e-8"),
    pytest.param(torch.float16, {"fused": True}, id="fused adds eps in fp32"),
])
def test_amp104_quiet(dtype, kwargs):
    model = nn.Linear(4, 4).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), **kwargs)
    assert list(adam_eps_underflow(TrainingSetup(model, opt))) == []


def test_amp104_quiet_when_master_weights_step_fp32_copies(master_weights):
    model = nn.Linear(4, 4).half()
    opt = master_weights(torch.optim.AdamW(model.parameters()))
    assert list(adam_eps_underflow(TrainingSetup(model, opt))) == []


def test_amp104_quiet_for_sgd():
    model = nn.Linear(4, 4).half()
    assert list(adam_eps_underflow(TrainingSetup(model, torch.optim.SGD(model.parameters(), lr=0.1)))) == []


# ---- AMP105 -----------------------------------------------------------------------------------------------------
def test_amp105_fires_for_a_fused_optimizer_over_fp16_params():
    model = mlp()
    model[2].half()
    opt = torch.optim.AdamW(model[2].parameters(), fused=True)
    findings = list(fused_optimizer_fp16_params(TrainingSetup(model, opt, cpu_scaler())))

    assert [f.code for f in findings] == ["AMP105"]
    assert findings[0].where == "optimizer[0]"
    assert "fused AdamW" in findings[0].detail and "2.weight" in findings[0].detail
    assert "unscale_" in findings[0].detail


def test_amp105_premise_fused_step_is_silent_until_unscale():
    model = nn.Linear(4, 4).half()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = cpu_scaler()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4, dtype=torch.float16)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)  # no error: fused optimizers get allow_fp16=True
    scaler.update()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4, dtype=torch.float16)).float().sum()
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


@pytest.mark.parametrize("dtype, fused", [(torch.float16, False), (torch.float32, True)],
                         ids=["fp16 not fused", "fused over fp32"])
def test_amp105_quiet(dtype, fused):
    model = nn.Linear(4, 4).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), fused=fused)
    assert list(fused_optimizer_fp16_params(TrainingSetup(model, opt, cpu_scaler()))) == []


def test_a_scaler_patched_to_accept_fp16_grads_is_pure_fp16_training_not_a_crash() -> None:
    # kohya-ss/sd-scripts' --full_fp16 replaces the scaler's _unscale_grads_ by one that passes allow_fp16=True:
    # unscale_() no longer raises, and the fp16 weights are updated in place (AMP103), not refused (AMP101).
    from ampdoctor.preflight.engine import check

    model = nn.Linear(4, 4).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    assert [f.code for f in check(model, opt, scaler).findings] == ["AMP101"]
    original = scaler._unscale_grads_
    scaler._unscale_grads_ = lambda opt_, inv, found, allow_fp16: original(opt_, inv, found, True)   # the patch
    [finding] = check(model, opt, scaler).findings
    assert finding.code == "AMP103" and "patched to accept float16 gradients" in finding.detail
    # the claim holds: a real step runs, with fp16 gradients
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4, dtype=torch.float16)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    # a wrapper that still refuses fp16 (it only logs) changes nothing: AMP101 stays
    scaler._unscale_grads_ = lambda opt_, inv, found, allow_fp16: original(opt_, inv, found, allow_fp16)
    assert [f.code for f in check(model, opt, scaler).findings] == ["AMP101"]


# ---- what the share of float16 trainable parameters says about its cause ----------------------------------------
class _SavedCopy(nn.Module):
    """peft's ModulesToSaveWrapper, by its names: the original module and a trainable copy per adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.original_module = nn.Linear(4, 4).half().requires_grad_(False)
        self.modules_to_save = nn.ModuleDict({"default": nn.Linear(4, 4).half()})


def _amp101_detail(models, params) -> str:
    report = check(models, torch.optim.SGD(params, lr=0.1), torch.amp.GradScaler("cpu"), select="AMP101")
    return report.findings[0].detail


def test_float16_modules_to_save_copies_are_named_as_such_not_stray_casts():
    model = nn.Sequential(nn.Linear(4, 4), _SavedCopy())   # a float32 trainable part next to the copy
    detail = _amp101_detail(model, [p for p in model.parameters() if p.requires_grad])
    assert "all of them in peft's modules_to_save copies" in detail and "stray casts" not in detail


def test_a_second_model_left_in_float16_is_named_as_left_out_of_the_upcast():
    unet, text_encoder = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4).half())
    detail = _amp101_detail([unet, text_encoder], [*unet.parameters(), *text_encoder.parameters()])
    assert "every one of Sequential's, while the other models train in float32: Sequential was left out" in detail
    # one stray half submodule of one model is still a stray cast
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4).half())
    assert "stray casts" in _amp101_detail(model, list(model.parameters()))
