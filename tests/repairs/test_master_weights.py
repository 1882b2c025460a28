import copy
import doctest
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor.repairs.master_weights
from ampdoctor.repairs.master_weights import MasterWeights, is_managed


@pytest.fixture(autouse=True)
def _no_global_hooks_left_behind():
    """Remove the global forward pre-hooks a test's MasterWeights left attached on purpose (a wrapper dropped while
    its optimizer lives, the docstring example): a later test elsewhere asserts that nothing of ours is left."""
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = set(hooks)
    yield
    for key in set(hooks) - before:
        del hooks[key]

X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
Y = X[:, :1] * 2 + X[:, 1:2].sin()
_U = 2.0**-11  # fp16 unit roundoff: 11 significant bits


def _mlp(dtype=torch.float16, seed=0, width=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1)).to(dtype)


def _batch(step, size=16):
    start = (step * size) % len(X)
    return X[start : start + size], Y[start : start + size]


def _loss(model, x, y, dtype=torch.float16):
    return F.mse_loss(model(x.to(dtype)).float(), y)


def _scaler_step(model, opt, scaler, step, clip=True):
    x, y = _batch(step)
    opt.zero_grad()
    loss = _loss(model, x, y)
    scaler.scale(loss).backward()
    if clip:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return loss.detach()


class Lion(torch.optim.Optimizer):
    """A third-party optimizer as they are usually written (Chen et al. 2023), old-style p.data updates included."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.data.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg * beta1 + p.grad * (1 - beta1)
                p.add_(update.sign(), alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


OPTIMIZERS = {
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "lion": lambda params: Lion(params, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unchanged_scaler_loop_with_unscale_and_clipping_trains(name):
    model = _mlp()
    with MasterWeights(OPTIMIZERS[name](model.parameters())) as opt:
        scaler = torch.amp.GradScaler("cpu")
        with torch.no_grad():
            before = _loss(model, X, Y)
        losses = torch.stack([_scaler_step(model, opt, scaler, step) for step in range(30)])
        with torch.no_grad():
            after = _loss(model, X, Y)
        assert torch.isfinite(losses).all()
        assert after < 0.5 * before
        assert all(p.dtype == torch.float16 for p in model.parameters())
        assert all(m.dtype == torch.float32 for m in opt.masters)
        states = [t for s in opt.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t)]
        assert states and all(t.dtype == torch.float32 for t in states)


@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_adamw_takes_the_scalers_fused_path(unscale_first):
    model = _mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    seen = []
    inner.register_step_pre_hook(lambda o, args, kwargs: seen.append(getattr(o, "found_inf", None)))
    with MasterWeights(inner) as opt:
        assert opt._step_supports_amp_scaling
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # no overflow: the kernel must apply the update
        before = [m.clone() for m in opt.masters]
        _scaler_step(model, opt, scaler, 0, clip=unscale_first)
        # GradScaler handed found_inf to the wrapper, which handed it to the fused kernel, and took it back.
        assert seen and torch.is_tensor(seen[0]) and seen[0].item() == 0
        assert not hasattr(inner, "found_inf") and not hasattr(opt, "found_inf")
        assert all(not torch.equal(a, b) for a, b in zip(before, opt.masters))


def test_params_are_half_in_forward_fp32_from_backward_to_step_and_half_after():
    model = _mlp()
    dtypes_in_forward = []
    model[0].register_forward_pre_hook(lambda m, args: dtypes_in_forward.append(m.weight.dtype))
    with MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3)) as opt:
        for step in range(2):
            x, y = _batch(step)
            _loss(model, x, y).backward()
            assert model[0].weight.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float32
            assert model[0].weight.data_ptr() == opt.masters[0].data_ptr()
            opt.step()
            assert model[0].weight.dtype == torch.float16 and model[0].weight.grad is None
            torch.testing.assert_close(model[0].weight.float(), opt.masters[0].half().float(), rtol=0, atol=0)
            opt.zero_grad()
    assert dtypes_in_forward == [torch.float16, torch.float16]


def test_the_switch_to_fp32_happens_once_when_backward_ends():
    model = _mlp()
    seen_during_backward = []
    with MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1)):
        # Backward reaches the last layer first; when the first layer's gradient lands, all is still half.
        model[0].weight.register_post_accumulate_grad_hook(
            lambda p: seen_during_backward.append((p.dtype, model[2].weight.dtype, model[2].weight.grad.dtype))
        )
        x, y = _batch(0)
        _loss(model, x, y).backward()
        assert seen_during_backward == [(torch.float16, torch.float16, torch.float16)]
        assert {(p.dtype, p.grad.dtype) for p in model.parameters()} == {(torch.float32, torch.float32)}


def test_gradient_accumulation_sums_the_micro_batches_in_fp32():
    model = _mlp()
    twin = copy.deepcopy(model)
    (x1, y1), (x2, y2) = _batch(0), _batch(1)
    expected = []
    for x, y in ((x1, y1), (x2, y2)):
        twin.zero_grad()
        _loss(twin, x, y).backward()
        expected.append([p.grad.float() for p in twin.parameters()])
    with MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1)):
        _loss(model, x1, y1).backward()
        _loss(model, x2, y2).backward()
        for p, g1, g2 in zip(model.parameters(), *expected):
            assert p.grad.dtype == torch.float32
            # Each micro-batch's half gradient is the twin's, exactly; one fp32 addition joins them.
            torch.testing.assert_close(p.grad, g1 + g2, rtol=0, atol=0)


@pytest.mark.parametrize("zero", ["wrapper", "model", "model-set_to_none=False", "inner"])
def test_zero_grad_between_micro_batches_from_any_caller_is_respected(zero):
    model = _mlp()
    twin = copy.deepcopy(model)
    (x1, y1), (x2, y2) = _batch(0), _batch(1)
    _loss(twin, x2, y2).backward()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with MasterWeights(inner) as opt:
        _loss(model, x1, y1).backward()
        loss = _loss(model, x2, y2)  # forward: the fp32 gradient of batch 1 is held aside
        {
            "wrapper": lambda: opt.zero_grad(),
            "model": lambda: model.zero_grad(),
            "model-set_to_none=False": lambda: model.zero_grad(set_to_none=False),
            "inner": lambda: inner.zero_grad(),
        }[zero]()
        loss.backward()
        for p, t in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, t.grad.float(), rtol=0, atol=0)


def test_zero_grad_in_update_phase_and_skipped_step_then_model_zero_grad():
    model = _mlp()
    with MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1)) as opt:
        x, y = _batch(0)
        _loss(model, x, y).backward()
        opt.zero_grad(set_to_none=False)
        assert all(p.grad.dtype == torch.float32 and not p.grad.any() for p in model.parameters())
        # GradScaler skips opt.step() on overflow, so gradients stay; the usual loop then runs
        # forward; zero_grad; backward. The held gradient of the skipped step must not come back.
        for p in model.parameters():
            p.grad.fill_(float("inf"))
        loss = _loss(model, x, y)
        model.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_two_param_groups_keep_their_learning_rates_and_fp32_params_pass_through():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1)).half()
    model[1].float()  # a norm kept in fp32 on purpose
    groups = [
        {"params": model[0].parameters(), "lr": 0.05},
        {"params": model[1].parameters(), "lr": 0.05},
        {"params": model[2].parameters(), "lr": 0.0},
    ]
    with MasterWeights(torch.optim.SGD(groups)) as opt:
        half_params = [*model[0].parameters(), *model[2].parameters()]
        assert [id(p) for p in opt.wrapped_params()] == [id(p) for p in half_params]
        norm_storage = model[1].weight.data_ptr()
        before = [m.clone() for m in opt.masters]
        norm_before = model[1].weight.detach().clone()
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            F.mse_loss(model[2](model[1](model[0](x.half()).float()).half()).float(), y).backward()
            opt.step()
        assert not torch.equal(opt.masters[0], before[0])  # lr 0.05
        assert torch.equal(opt.masters[2], before[2]) and torch.equal(opt.masters[3], before[3])  # lr 0
        assert model[1].weight.dtype == torch.float32 and model[1].weight.data_ptr() == norm_storage
        assert not torch.equal(model[1].weight, norm_before)


def test_step_lr_scheduler_drives_the_wrapped_learning_rate():
    model = _mlp()
    with MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1)) as opt:
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
            for step in range(4):
                _scaler_step(model, opt, scaler, step)
                scheduler.step()
        assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
        assert scheduler.get_last_lr() == [pytest.approx(0.025)]


def _train(model, opt, scaler, steps, start=0):
    for step in range(start, start + steps):
        _scaler_step(model, opt, scaler, step)


def test_state_dict_resumes_into_a_fresh_wrapper_exactly():
    model = _mlp()
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("cpu")
    _train(model, opt, scaler, 5)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()})
    # The masters hold more than their half copies: a model checkpoint alone would lose that.
    assert any(not torch.equal(m, m.half().float()) for m in checkpoint["opt"]["master_weights"].values())
    _train(model, opt, scaler, 2, start=5)
    continued = [m.clone() for m in opt.masters]
    opt.detach()

    fresh_model = _mlp(seed=123)
    fresh = MasterWeights(torch.optim.AdamW(fresh_model.parameters(), lr=1e-2))
    fresh_scaler = torch.amp.GradScaler("cpu")
    fresh_model.load_state_dict(checkpoint["model"])
    fresh.load_state_dict(checkpoint["opt"])
    fresh_scaler.load_state_dict(checkpoint["scaler"])
    for saved, master in zip(checkpoint["opt"]["master_weights"].values(), fresh.masters):
        assert torch.equal(saved, master)
    assert all(t.dtype == torch.float32 for s in fresh.state.values() for k, t in s.items() if k != "step")
    _train(fresh_model, fresh, fresh_scaler, 2, start=5)
    for a, b in zip(continued, fresh.masters):
        assert torch.equal(a, b)
    fresh.detach()


def test_state_dict_round_trip_on_the_same_wrapper_and_refusals():
    model = _mlp()
    with MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2)) as opt:
        _train(model, opt, torch.amp.GradScaler("cpu"), 3)
        state = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(copy.deepcopy(state))
        assert all(torch.equal(a, b) for a, b in zip(state["master_weights"].values(), opt.masters))
        assert model[0].weight.dtype == torch.float16
        with pytest.raises(ValueError, match="master_weights"):
            opt.load_state_dict(state["optimizer"])
        with pytest.raises(ValueError, match="shape"):
            opt.load_state_dict({**state, "master_weights": {k: v[:1] for k, v in state["master_weights"].items()}})
        other = torch.optim.AdamW([{"params": [p]} for p in _mlp().parameters()]).state_dict()
        shifted = {k: v + 1 for k, v in state["master_weights"].items()}
        masters = [m.clone() for m in opt.masters]
        with pytest.raises(ValueError, match="parameter groups"):  # torch's own refusal
            opt.load_state_dict({"optimizer": other, "master_weights": shifted})
        assert all(torch.equal(a, b) for a, b in zip(masters, opt.masters))
        assert model[0].weight.dtype == torch.float16


def test_detach_leaves_half_params_with_latest_masters_and_removes_every_hook():
    global_hooks = len(nn.modules.module._global_forward_pre_hooks)
    model = _mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = MasterWeights(inner)
    assert len(nn.modules.module._global_forward_pre_hooks) == global_hooks + 1
    _train(model, opt, torch.amp.GradScaler("cpu"), 3)
    x, y = _batch(0)
    _loss(model, x, y).backward()  # leave fp32 gradients pending
    opt.detach()
    assert len(nn.modules.module._global_forward_pre_hooks) == global_hooks
    assert not inner._optimizer_step_pre_hooks and not inner._optimizer_step_post_hooks
    for p, master in zip(model.parameters(), opt.masters):
        assert p.dtype == torch.float16 and p.grad.dtype == torch.float16 and not is_managed(p)
        assert torch.equal(p.detach(), master.half())
    model.zero_grad()
    _loss(model, x, y).backward()  # no hook left: gradients stay half
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())


def test_dropping_model_and_optimizer_without_detach_frees_everything():
    global_hooks = len(nn.modules.module._global_forward_pre_hooks)
    model = _mlp()
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, opt, torch.amp.GradScaler("cpu"), 2)
    weak_param = weakref.ref(next(model.parameters()))
    del model, opt
    gc.collect()
    assert weak_param() is None
    assert len(nn.modules.module._global_forward_pre_hooks) == global_hooks


def test_keeping_the_inner_optimizer_in_the_loop_works_too():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    masters = MasterWeights(opt).masters  # the wrapper itself is dropped: the optimizer keeps it attached
    gc.collect()
    before = [m.clone() for m in masters]
    _train(model, opt, torch.amp.GradScaler("cpu"), 3)  # scaler and clipping on the plain optimizer
    assert all(not torch.equal(a, b) for a, b in zip(before, masters))
    assert all(p.dtype == torch.float16 for p in model.parameters())


def test_a_module_run_between_backward_and_step_does_not_end_the_update_phase():
    model, metric = _mlp(), nn.Linear(8, 1).half()
    with MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1)) as opt:
        scaler = torch.amp.GradScaler("cpu")
        x, y = _batch(0)
        scaler.scale(_loss(model, x, y)).backward()
        metric(x.half())
        scaler.unscale_(opt)  # would raise "Attempting to unscale FP16 gradients." in the half phase
        scaler.step(opt)
        scaler.update()


def test_grads_assigned_by_hand_are_picked_up_by_step():
    model = _mlp()
    with MasterWeights(torch.optim.SGD(model.parameters(), lr=1.0)) as opt:
        for p in model.parameters():
            p.grad = torch.full_like(p, 2.0**-12)  # below half an ulp of most weights: lost in a half update
        before = [m.clone() for m in opt.masters]
        opt.step()
        for b, m in zip(before, opt.masters):
            torch.testing.assert_close(m, b - 2.0**-12, rtol=0, atol=1e-7)


def test_weights_written_into_the_half_model_reach_the_masters():
    model, other = _mlp(), _mlp(seed=7)
    with MasterWeights(torch.optim.SGD(model.parameters(), lr=0.0)) as opt:
        model.load_state_dict(other.state_dict())  # e.g. loading pretrained weights after building the optimizer
        x, y = _batch(0)
        _loss(model, x, y).backward()
        opt.step()
        for p, q in zip(model.parameters(), other.parameters()):
            assert torch.equal(p.detach(), q.detach())


def test_existing_half_optimizer_state_is_upcast_and_add_param_group_wraps():
    model, extra = _mlp(), nn.Linear(1, 1).half()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(0)
    _loss(model, x, y).backward()
    inner.step()  # a half step before wrapping: half exp_avg / exp_avg_sq
    inner.zero_grad()
    with MasterWeights(inner) as opt:
        assert all(t.dtype == torch.float32 for s in opt.state.values() for k, t in s.items() if k != "step")
        meta = nn.Linear(1, 1, device="meta").half()
        with pytest.raises(ValueError, match="meta device"):
            opt.add_param_group({"params": meta.parameters()})
        assert len(inner.param_groups) == 1
        opt.add_param_group({"params": extra.parameters(), "lr": 0.1})
        assert len(opt.wrapped_params()) == 6
        assert set(opt.state_dict()["master_weights"]) == {0, 1, 2, 3, 4, 5}
        F.mse_loss(extra(model(x.half())).float(), y).backward()
        assert extra.weight.grad.dtype == torch.float32
        opt.step()


def test_refusals_name_the_problem():
    with pytest.raises(TypeError, match="torch.optim.Optimizer, got list"):
        MasterWeights([torch.zeros(1)])
    model = _mlp()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already has a MasterWeights"):
        MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already a MasterWeights"):
        MasterWeights(opt)
    opt.detach()
    meta = nn.Linear(2, 2, device="meta").half()
    with pytest.raises(ValueError, match="meta device"):
        MasterWeights(torch.optim.SGD(meta.parameters(), lr=0.1))
    fp8 = nn.Parameter(torch.zeros(2, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        MasterWeights(torch.optim.SGD([fp8], lr=0.1))


def _run_amp_reference_and_master_weights(dtype, make_optimizer, steps, scaler):
    """Train the same initial weights two ways; return (losses, final fp32 weights) for both."""
    # Start both runs from weights that half represents exactly, so only the training differs.
    start = _mlp(dtype=torch.float32, seed=3, width=32).to(dtype).float()
    runs = {}
    for kind in ("amp", "master_weights"):
        model = copy.deepcopy(start)
        opt = make_optimizer(model.parameters())
        if kind == "master_weights":
            model.to(dtype)
            opt = MasterWeights(opt)
        grad_scaler = torch.amp.GradScaler("cpu", enabled=scaler)
        losses = []
        for step in range(steps):
            x, y = _batch(step, size=32)
            opt.zero_grad()
            if kind == "amp":
                with torch.autocast("cpu", dtype=dtype):
                    out = model(x)
            else:
                out = model(x.to(dtype))
            loss = F.mse_loss(out.float(), y)
            losses.append(loss.detach())
            grad_scaler.scale(loss).backward()
            if scaler:
                grad_scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            grad_scaler.step(opt)
            grad_scaler.update()
        if kind == "master_weights":
            weights = [m.clone() for m in opt.masters]
            opt.detach()
        else:
            weights = [p.detach().clone() for p in model.parameters()]
        runs[kind] = (torch.stack(losses), torch.cat([w.flatten() for w in weights]))
    return runs, torch.cat([p.detach().flatten() for p in start.parameters()])


def test_master_weights_track_the_fp32_amp_reference():
    runs, _ = _run_amp_reference_and_master_weights(
        torch.float16, lambda params: torch.optim.Adam(params, lr=1e-3), steps=100, scaler=True
    )
    (amp_losses, amp_weights), (mw_losses, mw_weights) = runs["amp"], runs["master_weights"]
    assert amp_losses[-10:].mean() < 0.6 * amp_losses[:10].mean()  # it does learn: the comparison means something
    # Both runs do the same arithmetic: the same fp32 weights rounded to fp16 for the forward, the same fp16
    # matmuls, fp16 gradients cast to fp32, the same fp32 unscale, clip and Adam update. On this CPU they agree bit
    # for bit. The tolerance only allows for an autocast kernel that rounds differently: one fp16 rounding per
    # output (relative u = 2**-11 ≈ 4.9e-4) enters the squared error twice (2u), compounded over the two layers
    # (4u); Adam's step size is set by lr, not by the gradient, so 100 steps of gradients perturbed by ~u move the
    # weights by ~100 * lr * u, far below the weights' own rounding. Hence rtol = 8u ≈ 3.9e-3 on every loss.
    torch.testing.assert_close(mw_losses, amp_losses, rtol=8 * _U, atol=0)
    torch.testing.assert_close(mw_weights, amp_weights, rtol=8 * _U, atol=8 * _U * amp_weights.abs().max().item())


@pytest.mark.parametrize(("dtype", "lr"), [(torch.float16, 3e-4), (torch.bfloat16, 1e-3)])
def test_pure_half_training_loses_small_updates_that_master_weights_keep(dtype, lr):
    # SGD with a small lr: each update lr*g is mostly below half an ulp of its weight (|w| * 2**-11 for fp16,
    # |w| * 2**-8 for bf16), so a half-precision update rounds back to the same weight.
    sgd = lambda params: torch.optim.SGD(params, lr=lr)  # noqa: E731
    runs, start = _run_amp_reference_and_master_weights(dtype, sgd, steps=100, scaler=False)
    reference_moved = runs["amp"][1] - start
    master_weights_moved = runs["master_weights"][1] - start

    pure = _mlp(dtype=torch.float32, seed=3, width=32).to(dtype)  # the same start, plain optimizer, no masters
    opt = sgd(pure.parameters())
    for step in range(100):
        x, y = _batch(step, size=32)
        opt.zero_grad()
        F.mse_loss(pure(x.to(dtype)).float(), y).backward()
        opt.step()
    pure_moved = torch.cat([p.detach().float().flatten() for p in pure.parameters()]) - start

    def error(moved):
        return ((moved - reference_moved).norm() / reference_moved.norm()).item()

    assert (reference_moved == 0).float().mean() < 0.01
    assert (pure_moved == 0).float().mean() > 0.5  # most weights never moved at all
    assert error(pure_moved) > 0.15
    # Same arithmetic as the AMP reference (see above); it agrees exactly here. 1% allows a different kernel.
    assert error(master_weights_moved) < 0.01
    assert (master_weights_moved == 0).float().mean() < 0.01


def test_docstring_example_runs():
    result = doctest.testmod(ampdoctor.repairs.master_weights)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_transitions_do_not_sync_with_the_host():
    model = _mlp().cuda()
    with MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)) as opt:
        x, y = _batch(0)
        x, y = x.cuda().half(), y.cuda()
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()  # first step: optimizer state allocation done
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                F.mse_loss(model(x).float(), y).backward()
                opt.step()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(p.dtype == torch.float16 for p in model.parameters())
