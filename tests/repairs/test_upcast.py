import doctest

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor.repairs.upcast
from ampdoctor.repairs.master_weights import MasterWeights
from ampdoctor.repairs.upcast import Change, fix, upcast_trainable_params_

X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
Y = X[:, :1] * 2 + X[:, 1:2].sin()


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _train_amp(model, opt, steps, dtype=torch.float16):
    """The reference AMP loop: autocast forward, GradScaler, unscale_ + clipping, step."""
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step in range(steps):
        start = (step * 16) % len(X)
        x, y = X[start : start + 16], Y[start : start + 16]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    return torch.stack(losses)


def _full_loss(model):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        return F.mse_loss(model(X).float(), Y)


def test_the_seed_scenario_fails_without_fix_and_trains_with_it():
    model = _mlp().half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        _train_amp(model, opt, 1)

    model = _mlp().half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    changes = fix(model, opt)
    assert [(c.name, c.what) for c in changes] == [(n, "upcast") for n in ("0.weight", "0.bias", "2.weight", "2.bias")]
    before = _full_loss(model)
    losses = _train_amp(model, opt, 30)
    assert torch.isfinite(losses).all()
    assert _full_loss(model) < 0.5 * before


def test_upcast_keeps_the_parameter_objects_and_leaves_frozen_ones_alone():
    model = _mlp().half()
    model[0].requires_grad_(False)  # a frozen half base, as in LoRA
    ids = [id(p) for p in model.parameters()]
    changes = upcast_trainable_params_(model)
    assert [id(p) for p in model.parameters()] == ids
    assert [p.dtype for p in model.parameters()] == [torch.float16, torch.float16, torch.float32, torch.float32]
    assert [str(c) for c in changes] == [
        "2.weight: upcast torch.float16 -> torch.float32",
        "2.bias: upcast torch.float16 -> torch.float32",
    ]
    assert upcast_trainable_params_(model) == []


def test_values_and_gradients_are_kept_exactly():
    model = _mlp().to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.mse_loss(model(X).float(), Y).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    changes = upcast_trainable_params_(model)
    assert ("0.weight", "grad", "torch.bfloat16", "torch.float32") in [tuple(c.to_dict().values()) for c in changes]
    for p, w, g in zip(model.parameters(), weights, grads):
        assert p.dtype == p.grad.dtype == torch.float32
        assert torch.equal(p.detach(), w.float()) and torch.equal(p.grad, g.float())


def test_optimizer_state_is_migrated_and_adamw_keeps_training():
    model = _mlp().half()
    # eps=1e-4: the default 1e-8 is 0 in fp16, and a zero gradient then gives 0/0 = NaN in a pure-fp16 step.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    F.mse_loss(model(X.half()).float(), Y).backward()
    opt.step()  # a pure-fp16 step: exp_avg and exp_avg_sq are fp16
    opt.zero_grad()
    steps = {id(p): opt.state[p]["step"] for p in model.parameters()}
    exp_avg = opt.state[model[0].weight]["exp_avg"].clone()

    changes = fix(model, opt)
    whats = {c.what for c in changes}
    assert whats == {"upcast", "optimizer state exp_avg", "optimizer state exp_avg_sq"}
    for p in model.parameters():
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert state["step"] is steps[id(p)]  # the counter is left alone
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], exp_avg.float())

    before = _full_loss(model)
    losses = _train_amp(model, opt, 20)
    assert torch.isfinite(losses).all() and _full_loss(model) < 0.7 * before


def test_a_second_optimizer_over_a_fixed_model_gets_its_state_migrated():
    model = _mlp().half()
    first, second = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) for _ in range(2))
    F.mse_loss(model(X.half()).float(), Y).backward()
    second.step()
    assert fix(model, first)
    changes = upcast_trainable_params_(model, optimizer=second)
    assert {c.what for c in changes} == {"optimizer state momentum_buffer"}
    assert upcast_trainable_params_(model, optimizer=second) == []


def test_a_single_stray_fp16_module_in_an_fp32_model():
    model = _mlp()
    model[2].half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        _train_amp(model, opt, 1)
    assert [(c.name, c.what) for c in fix(model, opt)] == [
        ("2.weight", "upcast"), ("2.weight", "grad"), ("2.bias", "upcast"), ("2.bias", "grad")
    ]
    before = _full_loss(model)
    assert torch.isfinite(_train_amp(model, opt, 20)).all()
    assert _full_loss(model) < 0.7 * before


def test_a_bf16_model_under_an_fp16_scaler():
    model = _mlp().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(X.bfloat16()).float(), Y)
    loss.backward()
    # bf16 grads: what the CUDA unscale kernel rejects ("not implemented for 'BFloat16'").
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    opt.zero_grad()
    changes = fix(model, opt, scaler=torch.amp.GradScaler("cpu"))
    assert {(c.before, c.after) for c in changes} == {("torch.bfloat16", "torch.float32")}
    before = _full_loss(model)
    assert torch.isfinite(_train_amp(model, opt, 20)).all()
    assert _full_loss(model) < 0.7 * before


def test_parameters_only_the_optimizer_holds_are_named_by_position():
    model = nn.Linear(2, 2)
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    assert [str(c) for c in fix(model, opt)] == ["param[2]: upcast torch.float16 -> torch.float32"]
    assert extra.dtype == torch.float32


def test_fix_leaves_the_scaler_as_it_is():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(X).float(), Y)
    scaler.scale(loss).backward()
    model[0].half()  # something downcasts a module mid-iteration
    state = scaler.state_dict()
    assert [c.what for c in fix(model, opt, scaler)] == ["upcast", "grad", "upcast", "grad"]
    assert scaler.state_dict() == state
    scaler.step(opt)  # the iteration goes on: the grads were kept, scaled, now in fp32
    scaler.update()
    with pytest.raises(TypeError, match="torch.amp.GradScaler, got str"):
        fix(model, opt, scaler="fp16")


def test_refusals_say_what_is_wrong_and_change_nothing():
    with pytest.raises(TypeError, match="torch.nn.Module, got list"):
        fix([nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="floating torch.dtype"):
        upcast_trainable_params_(nn.Linear(2, 2), dtype=torch.int32)
    with pytest.raises(TypeError, match="torch.optim.Optimizer, got dict"):
        fix(nn.Linear(2, 2), {"lr": 0.1})
    with pytest.raises(TypeError, match=r"second argument is the optimizer, got the dtype torch.float32.*dtype="):
        upcast_trainable_params_(nn.Linear(2, 2).half(), torch.float32)


def test_upcast_takes_the_optimizer_second_like_fix():
    # It used to be (model, dtype, optimizer): upcast_trainable_params_(model, opt) failed with "dtype must be ...".
    model = nn.Linear(3, 3).half()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3).half()).float().sum().backward()
    opt.step()
    changes = upcast_trainable_params_(model, opt)
    assert model.weight.dtype == torch.float32
    assert opt.state[model.weight]["exp_avg"].dtype == torch.float32
    assert "optimizer state exp_avg_sq" in {c.what for c in changes}

    meta = nn.Sequential(nn.Linear(2, 2).half(), nn.Linear(2, 2, device="meta").half())
    with pytest.raises(ValueError, match=r"'1.weight' is on the meta device .*to_empty"):
        fix(meta)
    assert meta[0].weight.dtype == torch.float16  # checked before anything changed

    model = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="ComplexHalf support is experimental"):
        model.register_parameter("phase", nn.Parameter(torch.zeros(2, dtype=torch.complex32)))
    with pytest.raises(ValueError, match=r"'phase' is complex \(torch.complex32\)"):
        fix(model)

    half = nn.Linear(2, 2).half()
    with MasterWeights(torch.optim.SGD(half.parameters(), lr=0.1)) as opt:
        with pytest.raises(ValueError, match="managed by an ampdoctor.MasterWeights"):
            fix(half)
        with pytest.raises(ValueError, match="already keeps fp32 master weights"):
            fix(half, opt)


def test_refuses_dtensor_and_fsdp_parameters():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no process group already running")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Linear(4, 4).half()
        mesh = init_device_mesh("cpu", (1,))
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match=r"'weight' is a DTensor .*MixedPrecisionPolicy"):
            fix(model)
        with pytest.warns(UserWarning):  # world size 1: FSDP switches to NO_SHARD
            sharded = FullyShardedDataParallel(nn.Linear(4, 4).half(), device_id=torch.device("cpu"))
        with pytest.raises(ValueError, match=r"FlatParameter .*ShardedGradScaler"):
            fix(sharded)
    finally:
        dist.destroy_process_group()


def test_change_renders_and_serializes():
    change = Change("encoder.0.weight", "upcast", "torch.float16", "torch.float32")
    assert str(change) == "encoder.0.weight: upcast torch.float16 -> torch.float32"
    assert change.to_dict() == {
        "name": "encoder.0.weight", "what": "upcast", "before": "torch.float16", "after": "torch.float32"
    }


def test_docstring_examples_run():
    result = doctest.testmod(ampdoctor.repairs.upcast)
    assert result.attempted > 0 and result.failed == 0


def test_fix_upcasts_frozen_norms_so_the_forward_still_runs_under_cpu_autocast():
    # A trainable embedding next to a frozen fp16 LayerNorm (model.half(), norm frozen): after the embedding is
    # upcast, its fp32 output meets the fp16 LayerNorm, which CPU autocast does not run in fp32:
    # "mixed dtype (CPU): expect parameter to have scalar type of Float". fix() must not leave that behind.
    model = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 1)).half()
    model[1].requires_grad_(False)
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)).half()
    bn[1].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    changes = fix(model, opt) + fix(bn)
    assert {(c.name, c.what) for c in changes if c.what in ("upcast frozen norm", "upcast norm buffer")} == {
        ("1.weight", "upcast frozen norm"), ("1.bias", "upcast frozen norm"), ("1.running_mean", "upcast norm buffer"),
        ("1.running_var", "upcast norm buffer")}  # buffers: of a trainable BatchNorm too, so not called frozen
    assert not model[1].weight.requires_grad and bn[1].running_var.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        model(torch.randint(0, 10, (2, 3))).float().sum().backward()
        bn(torch.randn(1, 1, 5, 5)).float().sum().backward()
    assert fix(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2).half().requires_grad_(False))) == []  # nothing upcast
