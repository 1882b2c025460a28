"""AMP201–AMP205 and AMP209 on real GradScalers, a real accelerate Accelerator, a real transformers Trainer and real
FSDP wrappers (gloo, one process)."""

import socket
import warnings

import pytest
import torch
from torch import nn

from ampdoctor.core.training import TrainingSetup
from ampdoctor.preflight.engine import check
from ampdoctor.preflight.rules.config import (
    accelerate_fp16_not_in_effect,
    closure_with_scaler,
    cuda_scaler_disabled,
    fp16_autocast_without_scaler,
    fsdp_fp16_with_plain_scaler,
    scaler_with_bf16_autocast,
)

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CUDA-less fallback")


def cpu_scaler(**kwargs) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kwargs)


# ---- AMP201 -----------------------------------------------------------------------------------------------------
def test_amp201_fires_for_a_scaler_with_bf16_autocast():
    findings = list(scaler_with_bf16_autocast(TrainingSetup(nn.Linear(10, 10), scaler=cpu_scaler(),
                                                             autocast_dtype=torch.bfloat16)))
    assert [(f.code, f.where) for f in findings] == [("AMP201", "GradScaler")]
    assert "GradScaler('cpu')" in findings[0].detail and "bfloat16" in findings[0].detail


@pytest.mark.parametrize("scaler, dtype", [
    (cpu_scaler, torch.float16), (lambda: cpu_scaler(enabled=False), torch.bfloat16), (lambda: None, torch.bfloat16),
], ids=["fp16 autocast", "disabled scaler", "no scaler"])
def test_amp201_quiet(scaler, dtype):
    assert list(scaler_with_bf16_autocast(TrainingSetup(nn.Linear(10, 10), scaler=scaler(),
                                                         autocast_dtype=dtype))) == []


# ---- AMP202 -----------------------------------------------------------------------------------------------------
@pytest.fixture
def construction_facts():
    """The facts `ampdoctor run` records: GradScaler construction observed by the real process-wide observers."""
    from ampdoctor.runner.discovery import scaler_classes
    from ampdoctor.session.observers import GlobalObservers

    class Sink:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    def reraise(exc):
        raise exc

    observers = GlobalObservers(Sink(), on_error=reraise)
    handles = observers.attach(scaler_classes())
    yield observers.facts
    for handle in reversed(handles):
        handle.remove()


@needs_no_cuda
def test_amp202_fires_for_a_cuda_scaler_that_disabled_itself(construction_facts):
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = torch.amp.GradScaler("cuda")
    findings = list(cuda_scaler_disabled(TrainingSetup(nn.Linear(10, 10), scaler=scaler,
                                                        autocast_dtype=torch.float16, facts=construction_facts)))
    assert [(f.code, f.where) for f in findings] == [("AMP202", "GradScaler")]
    assert "GradScaler('cuda') was built with enabled=True" in findings[0].detail
    assert "fp16 gradients get no loss scaling" in findings[0].detail


@needs_no_cuda
def test_amp202_quiet_when_no_fp16_is_in_play(construction_facts):
    # nanoGPT on a CPU (karpathy/nanoGPT train.py at 3adf61e154c3): dtype 'float16' asks for an enabled scaler, but
    # `ctx = nullcontext()` on a CPU: fp32 weights, no autocast. The disabled scaler harms nothing: the run is fp32.
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = torch.amp.GradScaler("cuda")
    assert list(cuda_scaler_disabled(TrainingSetup(nn.Linear(10, 10), scaler=scaler, facts=construction_facts))) == []
    half = nn.Sequential(nn.Linear(10, 10).half(), nn.Linear(10, 2))   # a frozen fp16 layer: fp16 gradients flow
    half[0].requires_grad_(False)
    findings = list(cuda_scaler_disabled(TrainingSetup(half, scaler=scaler, facts=construction_facts)))
    assert [f.code for f in findings] == ["AMP202"] and "float16 layers make float16 gradients" in findings[0].detail


@needs_no_cuda
@pytest.mark.parametrize("build", [lambda: torch.amp.GradScaler("cuda", enabled=False),
                                   lambda: torch.amp.GradScaler("cuda", 2.0**16, 2.0, 0.5, 2000, False)],
                         ids=["keyword", "positional"])
def test_amp202_quiet_for_enabled_false_on_purpose(build, construction_facts):
    scaler = build()   # nanoGPT: GradScaler('cuda', enabled=(dtype == 'float16')) in a bf16 or fp32 run
    setup = TrainingSetup(nn.Linear(10, 10), scaler=scaler, autocast_dtype=torch.float16, facts=construction_facts)
    assert list(cuda_scaler_disabled(setup)) == []


@needs_no_cuda
def test_amp202_quiet_when_the_construction_was_not_seen():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = torch.amp.GradScaler("cuda")   # check() on objects built elsewhere: enabled=False looks the same
    assert list(cuda_scaler_disabled(TrainingSetup(nn.Linear(10, 10), scaler=scaler,
                                                    autocast_dtype=torch.float16))) == []


@needs_no_cuda
def test_amp202_quiet_for_a_disabled_cuda_scaler_under_bf16():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scaler = torch.amp.GradScaler("cuda")
    assert list(cuda_scaler_disabled(TrainingSetup(nn.Linear(10, 10), scaler=scaler,
                                                    autocast_dtype=torch.bfloat16))) == []


def test_amp202_quiet_for_a_cpu_scaler():
    assert list(cuda_scaler_disabled(TrainingSetup(nn.Linear(10, 10), scaler=cpu_scaler()))) == []


# ---- AMP203 -----------------------------------------------------------------------------------------------------
@pytest.fixture
def accelerator_factory():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the state is a process-wide singleton
    yield lambda **kwargs: accelerate.Accelerator(cpu=True, **kwargs)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_amp203_fires_for_fp16_accelerator_on_cpu(accelerator_factory):
    accelerator = accelerator_factory(mixed_precision="fp16")
    # what accelerate actually does on CPU: keeps the label, sets up nothing
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None and not accelerator.native_amp

    findings = list(accelerate_fp16_not_in_effect(TrainingSetup(nn.Linear(10, 10), accelerator=accelerator)))
    assert [(f.code, f.where) for f in findings] == [("AMP203", "Accelerator")]
    assert "native_amp=False" in findings[0].detail and "accelerator.scaler is None" in findings[0].detail
    assert "'cpu'" in findings[0].detail


def test_amp203_premise_prepared_forward_is_not_autocast(accelerator_factory):
    accelerator = accelerator_factory(mixed_precision="fp16")
    model = accelerator.prepare(nn.Linear(10, 10))
    with accelerator.autocast():
        assert model(torch.randn(2, 10)).dtype == torch.float32


@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_amp203_quiet(accelerator_factory, mixed_precision):
    accelerator = accelerator_factory(mixed_precision=mixed_precision)
    assert list(accelerate_fp16_not_in_effect(TrainingSetup(nn.Linear(10, 10), accelerator=accelerator))) == []


# ---- AMP209 -----------------------------------------------------------------------------------------------------
@pytest.fixture
def trainer_factory(tmp_path):
    """A real transformers ``Trainer`` over ``model`` with these ``TrainingArguments`` flags (not trained)."""
    transformers = pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the state is a process-wide singleton

    def make(model, **flags):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[],
                                              save_strategy="no", **flags)
        return transformers.Trainer(model=model, args=args)

    yield make
    AcceleratorState._reset_state(reset_partial_state=True)


def _two_layers(dtype=torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).to(dtype)


def test_amp209_fires_for_the_trainers_bf16_flag_on_a_half_model(trainer_factory):
    # check() given the Trainer's Accelerator: what ampdoctor run and the Trainer callback hand the rules too
    model = _two_layers(torch.bfloat16)
    trainer = trainer_factory(model, bf16=True)
    report = check(model, torch.optim.AdamW(model.parameters()), accelerator=trainer.accelerator)
    [finding] = [f for f in report.findings if f.code == "AMP209"]
    assert finding.where == "TrainingArguments(bf16=True)"
    assert "all 4 trainable parameters are bfloat16" in finding.detail and "0.weight" in finding.detail


@pytest.mark.parametrize("case", ["fp32 model", "no flag", "no accelerator given"])
def test_amp209_quiet(trainer_factory, case):
    model = _two_layers(torch.float32 if case == "fp32 model" else torch.bfloat16)
    trainer = trainer_factory(model, bf16=case != "no flag")
    accelerator = None if case == "no accelerator given" else trainer.accelerator
    report = check(model, torch.optim.AdamW(model.parameters()), accelerator=accelerator)
    assert "AMP209" not in report.codes()


# ---- AMP204 -----------------------------------------------------------------------------------------------------
def test_amp204_fires_for_lbfgs_with_an_enabled_scaler():
    model = nn.Linear(10, 10)
    opt = torch.optim.LBFGS(model.parameters())
    findings = list(closure_with_scaler(TrainingSetup(model, opt, cpu_scaler())))
    assert [(f.code, f.where) for f in findings] == [("AMP204", "optimizer[0]")]
    assert "LBFGS" in findings[0].detail


def test_amp204_premise_scaler_refuses_a_closure():
    model = nn.Linear(10, 10)
    opt = torch.optim.LBFGS(model.parameters())
    scaler = cpu_scaler()

    def closure():
        opt.zero_grad()
        loss = model(torch.randn(2, 10)).sum()
        scaler.scale(loss).backward()
        return loss

    closure()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported if GradScaler is enabled"):
        scaler.step(opt, closure=closure)


@pytest.mark.parametrize("optimizer, scaler", [
    (torch.optim.LBFGS, lambda: None), (torch.optim.LBFGS, lambda: cpu_scaler(enabled=False)),
    (torch.optim.SGD, cpu_scaler),
], ids=["LBFGS no scaler", "LBFGS disabled scaler", "SGD with scaler"])
def test_amp204_quiet(optimizer, scaler):
    model = nn.Linear(10, 10)
    opt = optimizer(model.parameters(), lr=0.1)
    assert list(closure_with_scaler(TrainingSetup(model, opt, scaler()))) == []


# ---- AMP205 -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    yield
    dist.destroy_process_group()


def fsdp1(param_dtype):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "switching to NO_SHARD since the world size is 1"
        policy = MixedPrecision(param_dtype=param_dtype) if param_dtype else None
        return FullyShardedDataParallel(nn.Sequential(nn.Linear(10, 10)), mixed_precision=policy,
                                        device_id=torch.device("cpu"))


def test_amp205_fires_for_fsdp_fp16_with_a_plain_scaler(process_group):
    model = fsdp1(torch.float16)
    opt = torch.optim.AdamW(model.parameters())
    findings = list(fsdp_fp16_with_plain_scaler(TrainingSetup(model, opt, cpu_scaler())))
    assert [(f.code, f.where) for f in findings] == [("AMP205", "(root)")]
    assert "GradScaler('cpu')" in findings[0].detail and "ShardedGradScaler" in findings[0].detail


def test_amp205_quiet_with_a_sharded_scaler(process_group):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = fsdp1(torch.float16)
    setup = TrainingSetup(model, torch.optim.AdamW(model.parameters()), ShardedGradScaler("cpu"))
    assert list(fsdp_fp16_with_plain_scaler(setup)) == []


def test_amp205_quiet_for_fsdp_without_fp16_params(process_group):
    model = fsdp1(None)
    setup = TrainingSetup(model, torch.optim.AdamW(model.parameters()), cpu_scaler())
    assert list(fsdp_fp16_with_plain_scaler(setup)) == []


def test_amp205_quiet_for_fsdp2_whose_dtensor_grads_sync_found_inf(process_group):
    # FSDP2 shards fp32 DTensors and DTensor all-reduces the scaler's found_inf, so a plain GradScaler is right
    # (accelerate builds one for FSDP2). The rule stays quiet as long as torch has that handler.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import _dispatch

    assert hasattr(_dispatch, "found_inf_reduce_handler")
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    for layer in model:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    assert model(torch.randn(2, 10)).dtype == torch.float16  # fp16 compute is real
    setup = TrainingSetup(model, torch.optim.AdamW(model.parameters()), cpu_scaler())
    assert list(fsdp_fp16_with_plain_scaler(setup)) == []


# ---- AMP208 -----------------------------------------------------------------------------------------------------
def test_amp208_fires_for_fp16_autocast_without_a_scaler():
    findings = list(fp16_autocast_without_scaler(TrainingSetup(nn.Linear(10, 10), autocast_dtype=torch.float16)))
    assert [(f.code, f.where) for f in findings] == [("AMP208", "torch.autocast")]
    assert "no GradScaler" in findings[0].detail


@pytest.mark.parametrize("setup", [
    lambda m: TrainingSetup(m, scaler=torch.amp.GradScaler("cpu"), autocast_dtype=torch.float16),
    lambda m: TrainingSetup(m, autocast_dtype=torch.bfloat16),
    lambda m: TrainingSetup(m),
], ids=["fp16-with-scaler", "bf16-no-scaler", "fp32"])
def test_amp208_quiet_with_a_scaler_bf16_or_fp32(setup):
    assert list(fp16_autocast_without_scaler(setup(nn.Linear(10, 10)))) == []
