"""ScalerGuard on real CPU training loops: each state-machine misuse, the silent ones, and a quiet correct loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.utils.clip_grad
from torch import nn

from ampdoctor.core.training import TrainingSetup
from ampdoctor.guard.scaler_guard import ScalerGuard

HUGE = 1e36   # times a scale of 65536 overflows fp32 (max 3.4e38): the scaler finds inf and skips the step


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def loss_of(model: nn.Module, i: int, factor: float = 1.0) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
    with torch.autocast("cpu", dtype=torch.float16):
        return model(x).float().pow(2).mean() * factor


def parts(model: nn.Module | None = None, opt_cls=torch.optim.SGD, **opt_kwargs):
    model = model if model is not None else mlp()
    opt = opt_cls(model.parameters(), **({"lr": 0.01} | opt_kwargs))
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, scaler, TrainingSetup(model, opt, scaler)


def codes(findings) -> list[str]:
    return sorted({f.code for f in findings})


def canonical_step(model, opt, scaler, i, factor=1.0, scheduler=None) -> None:
    """One correct iteration: scale -> backward -> unscale_ -> clip -> step -> update (-> scheduler if not skipped)."""
    scaler.scale(loss_of(model, i, factor)).backward()
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    if scheduler is not None and scaler.get_scale() >= before:
        scheduler.step()


# ---- crashes explained from the history ----------------------------------------------------------------------

def test_clip_per_micro_batch_is_amp401():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard, pytest.raises(RuntimeError, match="already been called") as info:
        for i in range(4):
            scaler.scale(loss_of(model, i) / 2).backward()
            scaler.unscale_(opt)                                  # on every micro-batch
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if (i + 1) % 2 == 0:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    findings = guard.explain(info.value)
    assert codes(findings) == ["AMP401"]
    assert findings[0].where == "optimizer[0] (SGD)"
    assert findings[0].detail.count("test_scaler_guard.py:") == 2
    assert "1 backward pass" in findings[0].detail
    assert codes(guard.findings()) == ["AMP401"]


def test_skip_guard_without_update_is_amp402():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard, pytest.raises(RuntimeError, match="already been called") as info:
        for i in range(4):
            opt.zero_grad()
            scaler.scale(loss_of(model, i, HUGE if i == 1 else 1.0)).backward()
            scaler.unscale_(opt)
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not torch.isfinite(norm):
                continue                                          # skips scaler.step() AND scaler.update()
            scaler.step(opt)
            scaler.update()
    findings = guard.explain(info.value)
    assert codes(findings) == ["AMP402"]
    assert findings[0].detail.count("test_scaler_guard.py:") == 2
    assert "returned nan" in findings[0].detail or "returned inf" in findings[0].detail
    assert findings[0].step == 1


def test_unscale_after_step_is_amp403_with_both_sites():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        scaler.scale(loss_of(model, 0)).backward()
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="after step") as info:
            scaler.unscale_(opt)
    findings = guard.explain(info.value)
    assert codes(findings) == ["AMP403"]
    assert findings[0].detail.count("test_scaler_guard.py:") == 2


def test_second_step_names_the_optimizer_and_both_sites():
    model = mlp()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.01)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ScalerGuard(scaler, TrainingSetup(model, [opt_a, opt_b], scaler)) as guard:
        scaler.scale(loss_of(model, 0)).backward()
        scaler.step(opt_a)
        scaler.step(opt_b)
        with pytest.raises(RuntimeError, match="step\\(\\) has already been called") as info:
            scaler.step(opt_b)
    findings = guard.explain(info.value)
    assert codes(findings) == ["AMP404"]
    assert findings[0].where == "optimizer[1] (SGD)"
    assert findings[0].detail.count("test_scaler_guard.py:") == 2
    assert "no scaler.update() completed since the first" in findings[0].detail
    assert "no scaler.scale() ran between them, so the second step reuses the same gradients" in findings[0].detail


def test_a_loop_without_update_is_amp404_saying_update_is_missing():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard, pytest.raises(RuntimeError, match="already been called") as info:
        for i in range(3):
            opt.zero_grad()
            scaler.scale(loss_of(model, i)).backward()
            scaler.step(opt)                                      # scaler.update() forgotten
    findings = guard.explain(info.value)
    assert codes(findings) == ["AMP404"]
    f = findings[0]
    assert f.where == "optimizer[0] (SGD)" and f.step == 0
    assert "no scaler.update() completed since the first" in f.detail
    assert "1 scaler.scale() call ran between the two steps" in f.detail
    assert "call scaler.update() after every scaler.step()" in f.detail


def test_backward_without_scale_on_a_fresh_scaler_is_amp405():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        loss_of(model, 0).backward()
        with pytest.raises(AssertionError, match="_scale is None") as info:
            scaler.step(opt)
    findings = guard.explain(info.value)
    assert codes(findings) == ["AMP405"]
    assert "scaler.step()" in findings[0].detail


def test_frozen_optimizer_params_are_amp406_from_the_guard():
    model = mlp()
    opt = torch.optim.SGD(model[2].parameters(), lr=0.01)
    model[2].requires_grad_(False)
    scaler = torch.amp.GradScaler("cpu")
    with ScalerGuard(scaler, TrainingSetup(model, opt, scaler)) as guard:
        scaler.scale(loss_of(model, 0)).backward()
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
            scaler.step(opt)                                      # step's own unscale_ finds no grads
    findings = guard.findings()
    assert codes(findings) == ["AMP406"]
    assert "2.weight" in findings[0].detail and "2.bias" in findings[0].detail and "frozen" in findings[0].detail


def test_explicit_unscale_then_step_without_grads_is_amp406():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        scaler.scale(loss_of(model, 0).detach().requires_grad_())   # nothing reaches the model
        scaler.unscale_(opt)
        with pytest.raises(AssertionError, match="No inf checks") as info:
            scaler.step(opt)
    findings = guard.explain(info.value)
    assert codes(findings) == ["AMP406"]
    assert "not used in the forward pass" in findings[0].detail


@pytest.mark.parametrize("unscale", [False, True])
def test_gradients_zeroed_between_backward_and_step_are_amp612_not_amp406(unscale: bool):
    # the backward reached every parameter; zero_grad() set the gradients to None before the step used them: not
    # "unused in the forward pass" (AMP406), as it said
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        scaler.scale(loss_of(model, 0)).backward()
        opt.zero_grad()
        if unscale:
            scaler.unscale_(opt)
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer") as info:
            scaler.step(opt)
        explained = guard.explain(info.value)
    assert [(f.code, f.where, f.step, f.severity.value) for f in explained] == \
        [("AMP612", "optimizer[0] (SGD)", 0, "error")]
    assert codes(guard.findings()) == ["AMP612"]


def test_a_scaled_loss_never_backpropagated_is_still_amp406():
    # scale() without .backward(): the gradients were never there, so no zero_grad() took them
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        scaler.scale(loss_of(model, 0))
        with pytest.raises(AssertionError, match="No inf checks") as info:
            scaler.step(opt)
    assert codes(guard.explain(info.value)) == ["AMP406"]


def test_update_without_step_is_amp407():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        scaler.scale(loss_of(model, 0)).backward()
        with pytest.raises(AssertionError, match="prior to update") as info:
            scaler.update()
    assert codes(guard.explain(info.value)) == ["AMP407"]


def test_fp16_params_raising_inside_step_are_named_by_the_guard():
    model = mlp()
    model[0].half()
    model, opt, scaler, setup = parts(model)
    with ScalerGuard(scaler, setup) as guard:
        scaler.scale(loss_of(model, 0)).backward()
        with pytest.raises(ValueError, match="FP16") as info:
            scaler.step(opt)
    assert codes(guard.findings()) == ["AMP101"]
    text = " ".join(f.detail for f in guard.explain(info.value))
    assert "0.weight" in text and "0.bias" in text and "2.weight" not in text


# ---- silent misuse -----------------------------------------------------------------------------------------------

def test_backward_on_unscaled_loss_after_init_is_amp405():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        for i in range(2):
            canonical_step(model, opt, scaler, i)
        loss_of(model, 2).backward()                             # scaler already initialised: nothing raises
        scaler.step(opt)
        scaler.update()
    findings = guard.findings()
    assert codes(findings) == ["AMP405"]
    assert findings[0].step == 2 and "no scaler.scale() call" in findings[0].detail


@pytest.mark.parametrize("params", [
    lambda m: m.parameters(),
    lambda m: (p for p in m.parameters() if p.requires_grad),
    lambda m: list(m.parameters()),
    lambda m: m[2].weight,
])
def test_clipping_scaled_grads_is_amp408(params):
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        for i in range(3):
            scaler.scale(loss_of(model, i)).backward()
            nn.utils.clip_grad_norm_(params(model), 1.0)          # before unscale_
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    findings = guard.findings()
    assert codes(findings) == ["AMP408"]
    assert findings[0].where == "optimizer[0] (SGD)"
    assert "seen in 3 iterations" in findings[0].detail


def test_clipping_scaled_grads_by_value_is_amp408():
    # clip_grad_value_(1.0) on grads still times 65536 caps every unscaled entry at 1/65536: training crawls
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        for i in range(2):
            scaler.scale(loss_of(model, i)).backward()
            nn.utils.clip_grad_value_(model.parameters(), clip_value=1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        scaler.scale(loss_of(model, 2)).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_value_(model.parameters(), 1.0)          # after unscale_: right
        scaler.step(opt)
        scaler.update()
    findings = guard.findings()
    assert codes(findings) == ["AMP408"]
    assert findings[0].detail.startswith("clip_grad_value_(clip_value=1.0) at test_scaler_guard.py:")
    assert "seen in 2 iterations" in findings[0].detail


def test_clipping_another_models_grads_is_not_amp408():
    model, opt, scaler, setup = parts()
    critic = nn.Linear(8, 1)                                        # trained in fp32, no scaler
    with ScalerGuard(scaler, setup) as guard:
        scaler.scale(loss_of(model, 0)).backward()
        critic(torch.randn(2, 8)).sum().backward()
        torch.nn.utils.clip_grad.clip_grad_norm_(critic.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    assert guard.findings() == []


def test_scheduler_stepping_on_a_skipped_step_is_amp409():
    model, opt, scaler, setup = parts()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    with ScalerGuard(scaler, setup) as guard:
        for i in range(5):
            scaler.scale(loss_of(model, i, HUGE if i == 3 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()                                          # every iteration, skipped or not
            opt.zero_grad()
        assert guard.skipped_iterations() == [3]
    findings = guard.findings()
    assert codes(findings) == ["AMP409"]
    assert findings[0].where == "StepLR on optimizer[0] (SGD)" and findings[0].step == 3


def test_resume_without_scaler_state_is_amp410():
    model, opt, scaler, _ = parts(opt_cls=torch.optim.Adam, lr=1e-3)
    for i in range(3):
        canonical_step(model, opt, scaler, i)
    checkpoint = {"model": model.state_dict(), "opt": opt.state_dict()}   # the scaler is forgotten

    model2, opt2, scaler2, setup2 = parts(opt_cls=torch.optim.Adam, lr=1e-3)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    with ScalerGuard(scaler2, setup2) as guard:
        canonical_step(model2, opt2, scaler2, 3)
    findings = guard.findings()
    assert codes(findings) == ["AMP410"]
    assert "step 3" in findings[0].detail


def test_resume_with_scaler_state_is_quiet():
    model, opt, scaler, _ = parts(opt_cls=torch.optim.Adam, lr=1e-3)
    canonical_step(model, opt, scaler, 0, factor=HUGE)            # one skip: scale 32768, tracker 0
    canonical_step(model, opt, scaler, 1)
    model2, opt2, scaler2, setup2 = parts(opt_cls=torch.optim.Adam, lr=1e-3)
    opt2.load_state_dict(opt.state_dict())
    scaler2.load_state_dict(scaler.state_dict())
    with ScalerGuard(scaler2, setup2) as guard:
        canonical_step(model2, opt2, scaler2, 2)
    assert guard.findings() == []


# ---- a correct loop is quiet, and the guard changes nothing ------------------------------------------------------

def train(steps: int, guard: bool, accum: int = 2) -> tuple[nn.Module, torch.amp.GradScaler, ScalerGuard | None]:
    model, opt, scaler, setup = parts(opt_cls=torch.optim.AdamW, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    watcher = ScalerGuard(scaler, setup).attach() if guard else None
    try:
        _train_loop(model, opt, scaler, sched, steps, accum)
    finally:
        if watcher is not None:
            watcher.detach()
    return model, scaler, watcher


def _train_loop(model, opt, scaler, sched, steps: int, accum: int) -> None:
    for i in range(steps * accum):
        factor = HUGE if i in (6, 7) else 1.0                     # iteration 3 overflows and is skipped
        scaler.scale(loss_of(model, i, factor) / accum).backward()
        if (i + 1) % accum:
            continue
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.get_scale() >= before:                          # step only when the optimizer stepped
            sched.step()


def test_canonical_loop_with_accumulation_and_a_skipped_step_is_quiet():
    _, _, guard = train(10, guard=True)
    guard.detach()
    assert guard.skipped_iterations() == [3]                      # the skip really happened
    assert guard.findings() == []


def test_training_with_the_guard_is_bitwise_identical():
    plain, plain_scaler, _ = train(20, guard=False)
    watched, watched_scaler, _ = train(20, guard=True)
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)
    assert plain_scaler.state_dict() == watched_scaler.state_dict()


def test_detach_restores_everything():
    model, opt, scaler, setup = parts()
    originals = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_,
                 torch.optim.lr_scheduler.LRScheduler.step,
                 vars(torch.optim.lr_scheduler.CosineAnnealingWarmRestarts)["step"])
    with ScalerGuard(scaler, setup) as guard:
        assert "unscale_" in vars(scaler) and torch.nn.utils.clip_grad_norm_ is not originals[0]
        canonical_step(model, opt, scaler, 0)
    assert not {"scale", "unscale_", "step", "update"} & set(vars(scaler))
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_,
            torch.optim.lr_scheduler.LRScheduler.step,
            vars(torch.optim.lr_scheduler.CosineAnnealingWarmRestarts)["step"]) == originals
    assert len(scaler._per_optimizer_states) == 0             # the guard never adds scaler state
    guard.detach()                                              # twice is fine


def test_an_observer_error_is_reported_once_and_the_guard_steps_aside():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        guard._cur = None   # break the guard itself, not torch
        for i in range(3):
            canonical_step(model, opt, scaler, i)               # training goes on
        assert guard.broken
    findings = guard.findings()
    assert [f.code for f in findings] == ["AMP001"]
    assert "scale" not in vars(scaler) and torch.nn.utils.clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_


def test_a_disabled_scaler_is_ignored():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with ScalerGuard(scaler, TrainingSetup(model, opt, scaler)) as guard:
        for i in range(2):
            scaler.scale(loss_of(model, i)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    assert guard.findings() == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_guard_adds_no_host_sync_on_cuda():
    import warnings

    def syncs(guarded: bool) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cuda")
        guard = ScalerGuard(scaler, TrainingSetup(model, opt, scaler)).attach() if guarded else None
        x = torch.randn(4, 8, device="cuda")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(10):
                        with torch.autocast("cuda", dtype=torch.float16):
                            loss = model(x).float().pow(2).mean()
                        scaler.scale(loss).backward()
                        scaler.unscale_(opt)
                        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        scaler.step(opt)                      # torch's own .item() sync, once per step
                        scaler.update()
                        opt.zero_grad()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        finally:
            if guard is not None:
                guard.detach()
        # only the syncs: torch also warns once per process that the debug mode is a prototype (it said
        # "Synchronization", and was counted for whichever run came first)
        return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)

    assert syncs(guarded=True) == syncs(guarded=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_guard_with_a_scheduler_adds_no_host_sync_on_cuda():
    # AMP409's checks used to read their found-inf flags with .tolist() every 32 scheduler steps, mid-run; they are
    # counted on the device now and read when findings are asked for (seen on an H200: AMP001 under "error")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)   # fused: torch's own step does not sync
    scaler = torch.amp.GradScaler("cuda")
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.99)
    x = torch.randn(4, 8, device="cuda")
    with ScalerGuard(scaler, TrainingSetup(model, opt, scaler)) as guard:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(40):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert "AMP001" not in [f.code for f in guard.findings()]


# ---- AMP412: optimizer.step() around the scaler; AMP413: backward or step inside autocast --------------------------

def test_a_direct_optimizer_step_on_scaled_gradients_is_amp412():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        for i in range(3):
            scaler.scale(loss_of(model, i)).backward()
            opt.step()                                       # the update is 65536x too large
            opt.zero_grad()
    found = [f for f in guard.findings() if f.code == "AMP412"]
    assert len(found) == 1 and found[0].where == "optimizer[0] (SGD)"
    assert found[0].severity.value == "error"
    assert "optimizer[0] (SGD).step() at test_scaler_guard.py:" in found[0].detail
    assert "scaler.step(optimizer) then scaler.update()" in found[0].detail
    assert "the update is that many times too large" in found[0].detail   # SGD; Adam's eps acts smaller instead


def test_a_direct_step_before_update_is_amp412_next_to_the_update_crash():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard, pytest.raises(AssertionError, match="No inf checks"):
        scaler.scale(loss_of(model, 0)).backward()
        opt.step()
        scaler.update()
    assert codes(guard.findings()) == ["AMP407", "AMP412"]   # AMP412 says why update() had nothing to read


def test_a_second_optimizer_of_the_scaled_loss_stepped_directly_is_amp412():
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 1)
    opt_body, opt_head = torch.optim.SGD(body.parameters(), lr=0.01), torch.optim.SGD(head.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    model = nn.Sequential(body, head)
    with ScalerGuard(scaler, TrainingSetup(model, [opt_body, opt_head], scaler)) as guard:
        for i in range(2):
            scaler.scale(loss_of(model, i)).backward()
            scaler.step(opt_body)
            opt_head.step()                                  # forgot: scaler.step(opt_head)
            scaler.update()
            opt_body.zero_grad(), opt_head.zero_grad()
    assert [(f.code, f.where) for f in guard.findings()] == [("AMP412", "optimizer[1] (SGD)")]


def test_an_optimizer_outside_the_scaled_loss_stepped_directly_is_not_amp412():
    # A GAN-like loop: the discriminator trains through the scaler (on a detached fake), the generator in plain
    # fp32 with its own backward and step, in the same iteration.
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(disc.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ScalerGuard(scaler, TrainingSetup([disc, gen], [opt_d, opt_g], scaler)) as guard:
        for _ in range(3):
            fake = gen(torch.randn(4, 4))
            with torch.autocast("cpu", dtype=torch.float16):
                d_loss = disc(fake.detach()).float().pow(2).mean()
            scaler.scale(d_loss).backward()
            g_loss = fake.pow(2).mean()                      # fp32, unscaled
            g_loss.backward()
            opt_g.step()
            scaler.step(opt_d)
            scaler.update()
            opt_g.zero_grad(), opt_d.zero_grad()
    assert guard.findings() == []


# ---- iterations that no update() ends: direct steps the scaler took no part in ------------------------------------

def test_direct_steps_end_iterations_and_a_crash_is_explained_at_its_step():
    # AMP412's loop never calls update(): every iteration used to be iteration 0, the crash's step too
    model, opt, scaler, setup = parts(mlp().half())
    with ScalerGuard(scaler, setup) as guard:
        for i in range(3):
            scaler.scale(loss_of(model, i)).backward()
            opt.step()
            opt.zero_grad()
            assert guard.iteration == i + 1
        scaler.scale(loss_of(model, 3)).backward()
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients") as raised:
            scaler.step(opt)
        assert {(f.code, f.step) for f in guard.explain(raised.value)} == {("AMP101", 3)}
    [amp412] = [f for f in guard.findings() if f.code == "AMP412"]
    assert amp412.step == 0 and "(seen in 3 iterations, 0 to 2)" in amp412.detail


@pytest.mark.parametrize("shape", ["scaler unused", "two optimizers stepped directly", "update(new_scale)"])
def test_each_iteration_the_scaler_takes_no_part_in_counts_once(shape: str):
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(disc.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ScalerGuard(scaler, TrainingSetup([disc, gen], [opt_d, opt_g], scaler)) as guard:
        for i in range(4):
            fake = gen(torch.randn(4, 4))
            loss = disc(fake).pow(2).mean()
            (scaler.scale(loss) if shape == "update(new_scale)" else loss).backward()
            opt_d.step()
            if shape == "two optimizers stepped directly":   # a GAN's generator, after its discriminator
                opt_g.step()
            if shape == "update(new_scale)":
                scaler.update(2.0**10)
            opt_g.zero_grad(), opt_d.zero_grad()
            assert guard.iteration == i + 1
    assert codes(guard.findings()) == (["AMP412"] if shape == "update(new_scale)" else [])


@pytest.mark.parametrize("plain_first", [True, False])
def test_a_plain_optimizer_next_to_a_scaled_one_ends_no_iteration_of_its_own(plain_first: bool):
    # the GAN loop above, the fp32 generator's step first: before the first update() it ends iteration 0, and the
    # discriminator's update() that follows is part of it, not one more; last: after an update(), which ends them
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(disc.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with ScalerGuard(scaler, TrainingSetup([disc, gen], [opt_d, opt_g], scaler)) as guard:
        for i in range(3):
            fake = gen(torch.randn(4, 4))
            if plain_first:
                fake.pow(2).mean().backward(retain_graph=True)   # fp32, unscaled
                opt_g.step()
            with torch.autocast("cpu", dtype=torch.float16):
                d_loss = disc(fake.detach()).float().pow(2).mean()
            scaler.scale(d_loss).backward()
            scaler.step(opt_d)
            scaler.update()
            if not plain_first:
                fake.pow(2).mean().backward()
                opt_g.step()
            opt_g.zero_grad(), opt_d.zero_grad()
            assert guard.iteration == i + 1
    assert guard.findings() == []


def test_a_disabled_scaler_with_direct_steps_is_quiet():
    model, opt, _, _ = parts()
    scaler = torch.amp.GradScaler("cpu", enabled=False)      # scale() returns the loss itself
    with ScalerGuard(scaler, TrainingSetup(model, opt, scaler)) as guard:
        for i in range(2):
            scaler.scale(loss_of(model, i)).backward()
            opt.step()
            opt.zero_grad()
    assert guard.findings() == []


class ScalerSteppedSGD(torch.optim.SGD):
    """An optimizer whose own step goes through the scaler, as accelerate's AcceleratedOptimizer does."""

    def __init__(self, params, scaler: torch.amp.GradScaler, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.scaler = scaler
        self.stepping = False

    def step(self, closure=None):
        if self.stepping:                                    # the inner call, made by scaler.step(self)
            return super().step(closure)
        self.stepping = True
        try:
            return self.scaler.step(self)
        finally:
            self.stepping = False


def test_a_step_that_calls_scaler_step_itself_is_not_amp412():
    model = mlp()
    scaler = torch.amp.GradScaler("cpu")
    opt = ScalerSteppedSGD(model.parameters(), scaler, lr=0.01)
    with ScalerGuard(scaler, TrainingSetup(model, opt, scaler)) as guard:
        for i in range(3):
            scaler.scale(loss_of(model, i)).backward()
            opt.step()                                       # its step is scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert guard.findings() == []


def test_backward_inside_autocast_is_amp413():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        for i in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()                # inside the with block
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    found = guard.findings()
    assert [(f.code, f.where) for f in found] == [("AMP413", "loss.backward()")]
    assert found[0].severity.value == "warning"
    assert "scaler.scale(loss).backward() at test_scaler_guard.py:" in found[0].detail
    assert "torch.autocast('cpu')" in found[0].detail


def test_step_inside_autocast_is_amp413_on_the_optimizer():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        x = torch.randn(4, 8)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        with torch.autocast("cpu", dtype=torch.float16):
            scaler.step(opt)                                 # the optimizer's step runs inside autocast
            scaler.update()
    assert [(f.code, f.where) for f in guard.findings()] == [("AMP413", "optimizer[0] (SGD)")]


def test_backward_in_a_disabled_autocast_region_is_not_amp413():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        x = torch.randn(4, 8)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
            with torch.autocast("cpu", enabled=False):
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        with torch.autocast("cpu", enabled=False):
            scaler.scale(loss_of(model, 1)).backward()
            scaler.step(opt)
            scaler.update()
    assert guard.findings() == []


def test_the_canonical_loop_has_no_amp412_or_amp413():
    model, opt, scaler, setup = parts()
    with ScalerGuard(scaler, setup) as guard:
        for i in range(4):
            canonical_step(model, opt, scaler, i)
    assert guard.findings() == []


def test_detach_removes_the_optimizer_step_hooks():
    model, opt, scaler, setup = parts()
    pre, post = dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_step_post_hooks)
    with ScalerGuard(scaler, setup):
        assert len(opt._optimizer_step_pre_hooks) == len(pre) + 1
    assert dict(opt._optimizer_step_pre_hooks) == pre and dict(opt._optimizer_step_post_hooks) == post
