import copy
import doctest
import gc
import math
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



def _clip_temperature(dtype, master_weights, steps=8, lr=1e-3):
    """Train a CLIP-like learned temperature and return the master (or the fp32 weight) and the half copy's value
    after each step.

    The loop re-creates, in our own words, the parts of open_clip that matter here (mlfoundations/open_clip,
    src/open_clip_train/legacy_train.py at 89fb801f1e6087880e951fc8354b8a2077b79c6d, last changed in
    bfb1975131e83fecd5395aefa521073ad17b07a1; src/open_clip/model.py for the parameter): ``logit_scale`` is a
    parameter initialised to log(1 / 0.07) and exponentiated to scale the cosine logits, the loss is the mean of the
    image->text and text->image cross-entropies, AdamW leaves ``logit_scale`` out of weight decay, and after every
    optimizer step ``logit_scale.clamp_(0, math.log(100))`` runs under ``no_grad``; ``--precision pure_bf16`` casts
    the whole model to bf16. Both runs start from the same (bf16) values.
    """
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(16, 8, generator=g), dim=-1)
    text = F.normalize(image + 0.5 * torch.randn(16, 8, generator=g), dim=-1)
    torch.manual_seed(0)
    logit_scale = nn.Parameter(torch.full((), math.log(1 / 0.07)).to(torch.bfloat16).to(dtype))
    proj = nn.Linear(8, 8, bias=False).to(torch.bfloat16).to(dtype)
    opt = torch.optim.AdamW([{"params": [proj.weight], "weight_decay": 0.2},
                             {"params": [logit_scale], "weight_decay": 0.0}], lr=lr)
    if master_weights:
        opt = MasterWeights(opt)
    labels, values = torch.arange(16), []
    for _ in range(steps):
        logits = logit_scale.exp() * proj(image.to(dtype)) @ text.to(dtype).T
        loss = (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.T.float(), labels)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            logit_scale.clamp_(0, math.log(100))
        master = opt.masters[1] if master_weights else logit_scale
        values.append((master.item(), logit_scale.float().item()))
    if master_weights:
        opt.detach()
    return values


def test_a_clamp_after_each_step_leaves_the_master_moving_like_fp32():
    # The clamp rewrites the bf16 copy (and bumps its version counter) after every step without changing its
    # value. MasterWeights used to reload the master from that copy: the temperature stayed at exp(2.65625) = 14.24
    # for good, with ampdoctor's --fix saying "no findings left".
    reference = _clip_temperature(torch.float32, master_weights=False)
    fixed = _clip_temperature(torch.bfloat16, master_weights=True)
    plain = _clip_temperature(torch.bfloat16, master_weights=False)
    start = 2.65625   # log(1 / 0.07) = 2.6593 in bf16 (8 significant bits: steps of 2**-6 here)
    assert reference[-1][0] < start - 2**-7   # fp32 moves by more than half a bf16 ulp in 8 steps
    assert {half for _, half in plain} == {start}   # plain bf16 loses every step (each below half an ulp)
    # Adam's step is lr * m / sqrt(v): the bf16 forward changes the gradient by about 2**-8 of itself, which moves
    # m / sqrt(v) by as little when the gradient keeps its sign, so 8 steps drift by at most 8 * lr * 2**-8 = 3e-5.
    masters = torch.tensor([m for m, _ in fixed], dtype=torch.float64)
    torch.testing.assert_close(masters, torch.tensor([m for m, _ in reference], dtype=torch.float64),
                               rtol=0, atol=8 * 1e-3 * 2**-8)
    # and the half copy the forward uses is the master rounded: it moved off the start when fp32 crossed a midpoint
    assert [half for _, half in fixed] == [float(torch.tensor(m).to(torch.bfloat16)) for m, _ in fixed]
    assert fixed[-1][1] == start - 2**-6


def test_a_clamp_that_moves_an_entry_gives_its_master_the_clamped_value_and_spares_the_others():
    # entry 0 sits at the bound's bf16 value (log(100) = 4.6052 -> 4.59375) and each step pushes it past the bound
    # (+0.0390625: master 4.6328125, half copy 4.625); entry 1 moves by 2**-10 a step, less than half a bf16 ulp
    # (2**-8 at 1.0), which only its master keeps. Both steps are exact in bf16 and fp32.
    p = nn.Parameter(torch.tensor([4.59375, 1.0], dtype=torch.bfloat16))
    with MasterWeights(torch.optim.SGD([p], lr=1.0)) as opt:
        for _ in range(3):
            (p.float() * torch.tensor([-0.0390625, -(2**-10)])).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                p.clamp_(0, math.log(100))
        (p.float() * 0).sum().backward()   # the next backward: the masters take the clamp over
        # the clamp moved entry 0 back below the bound each time: its master is the clamped value itself, not the
        # master less what the clamp took off the half copy (4.6328125 - 0.03125 = 4.6015625, another value)
        assert opt.masters[0][0].item() == 4.59375
        assert opt.masters[0][1].item() == 1 + 3 * 2**-10   # three steps, none lost
        assert p.dtype == torch.float32


@pytest.mark.parametrize("write", ["copy_ into a slice", "fill_ of a row", "load_state_dict"])
def test_a_write_into_the_half_model_reaches_its_masters_exactly_and_the_rest_keep_their_bits(write):
    model = _mlp()
    with MasterWeights(torch.optim.SGD(model.parameters(), lr=1e-3)) as opt:
        _train(model, opt, torch.amp.GradScaler("cpu"), 3, start=0)
        kept = [m.clone() for m in opt.masters]
        assert all(not torch.equal(m, m.half().float()) for m in kept)   # more than the half copies hold
        weight = model[0].weight   # masters[0]
        new = torch.linspace(2.0, 3.0, weight.shape[1]).half()   # |weights| < 1: differs from every entry there
        with torch.no_grad():
            if write == "copy_ into a slice":
                weight[0].copy_(new)
            elif write == "fill_ of a row":
                weight[0].fill_(2.5)
                new = torch.full_like(new, 2.5)
            else:   # every tensor is written, all but one row with the values they already had
                state = model.state_dict()
                state["0.weight"] = state["0.weight"].clone()
                state["0.weight"][0] = new
                model.load_state_dict(state)
        x, y = _batch(3)
        _loss(model, x, y).backward()   # the update phase: the masters took the write over
        assert torch.equal(opt.masters[0][0], new.float())
        assert torch.equal(opt.masters[0][1:], kept[0][1:])
        assert all(torch.equal(m, k) for m, k in zip(opt.masters[1:], kept[1:]))

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
