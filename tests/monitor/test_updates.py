"""UpdateMonitor on real low-precision models and optimizers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampdoctor._torch.autograd import version_counter
from ampdoctor.monitor.updates import MOVED_SAMPLE, UpdateMonitor
from ampdoctor.monitor.watcher import watch
from ampdoctor.repairs.master_weights import MasterWeights


def sync(monitor: UpdateMonitor, step: int) -> dict:
    return monitor.consume({k: v.reshape(-1).tolist() for k, v in monitor.pending().items()}, step)


def bf16_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(torch.bfloat16)


def run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, scaler=None, inf_at=()) -> UpdateMonitor:
    monitor = UpdateMonitor(list(model.named_parameters())).attach(opt)
    for step in range(steps):
        monitor.set_sampling(True)
        x = torch.randn(8, 16, dtype=next(model.parameters()).dtype)
        loss = model(x).float().pow(2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if step in inf_at:
                model[2].bias.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        sync(monitor, step)
    monitor.detach()
    return monitor


def test_pure_bf16_with_a_small_lr_loses_most_updates() -> None:
    model = bf16_model()
    monitor = run(model, torch.optim.AdamW(model.parameters(), lr=1e-5), 4)
    assert monitor.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    fractions = monitor.fractions()
    assert set(fractions) == set(monitor.names) and all(f > 0.9 for f in fractions.values()), fractions
    assert [f.code for f in monitor.findings()] == ["AMP607"] * 4
    assert "bfloat16" in monitor.findings()[0].detail
    assert monitor.summary()["lost_fraction"] > 0.9


def test_pure_bf16_with_a_large_lr_keeps_its_updates() -> None:
    model = bf16_model()
    monitor = run(model, torch.optim.AdamW(model.parameters(), lr=1e-1), 4)
    assert max(monitor.fractions().values()) < 0.2
    assert monitor.findings() == []


def test_fp32_parameters_under_autocast_lose_no_updates_and_are_seen_to_move() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9)  # tiny updates, but fp32 keeps them
    with watch(model, opt, every=1) as w:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert "AMP607" not in w.report().codes()
    assert w.summary_data()["lost_updates"] is None   # no fp16/bf16 weight to lose one
    updates = w.summary_data()["updates"]
    assert updates["sampled_steps"] == 3 and updates["unmoved_steps"] == [] and updates["nonfinite"] == {}


def test_a_step_skipped_inside_the_fused_kernel_is_not_counted_as_lost() -> None:
    model = bf16_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-1, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    monitor = run(model, opt, 3, scaler=scaler, inf_at={0, 1, 2})  # every step skipped by the kernel
    assert scaler.get_scale() == 2.0**13
    assert monitor.with_grad == [0, 0, 0, 0] and monitor.fractions() == {}
    assert monitor.findings() == []


def test_fused_bf16_with_a_small_lr_and_a_scaler_loses_updates() -> None:
    model = bf16_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    monitor = run(model, opt, 2, scaler=torch.amp.GradScaler("cpu"))
    assert min(monitor.fractions().values()) > 0.9


def test_not_sampled_means_no_snapshot_and_detach_removes_the_hooks() -> None:
    model = bf16_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    monitor = UpdateMonitor(list(model.named_parameters()), sample=8).attach(opt)
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    model(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert monitor.pending() == {}
    monitor.detach()
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0


def test_nan_weights_are_not_counted_as_updated_or_lost() -> None:
    # a NaN weight compares unequal to itself after the step: it was not "updated", and nothing was "lost" either
    model = bf16_model()
    with torch.no_grad():
        model[2].weight.fill_(float("nan"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = run(model, opt, steps=2)
    summary = monitor.summary()
    assert "2.weight" not in summary["params"] and "2.weight" not in monitor.fractions()
    assert not [f for f in monitor.findings() if f.where == "2.weight"]


def test_weights_that_are_fp32_at_step_time_lose_nothing() -> None:
    # under MasterWeights the parameters hold their fp32 masters between backward and step
    model = bf16_model()
    master = MasterWeights(torch.optim.SGD(model.parameters(), lr=1e-6))  # tiny steps: lost in bf16, kept in fp32
    with master:
        monitor = run(model, master.optimizer, steps=3)
    assert monitor.findings() == []
    # still watched: whether each step's update was still in the master at the next step (all were)
    assert monitor.fractions() == dict.fromkeys(monitor.names, 0.0) and monitor.steps == 2


class ReloadingMasterWeights(MasterWeights):
    """``MasterWeights`` as it was before issue 41: after any write into a half copy it reloaded the whole master
    from it, so a write that changed nothing still rounded the master, and the last update, away."""

    def _follow_half_writes(self) -> None:
        written = [i for i, p in enumerate(self._params) if version_counter(p) != self._param_version[i]]
        for i in written:
            self._masters[i].copy_(self._halves[i])


def clamped_temperature(wrap, start: float, pull: float, lr: float = 1e-3, steps: int = 6,
                        closure: bool = False) -> UpdateMonitor:
    """Train a bf16 CLIP-like temperature under ``wrap(optimizer)``, clamped to [0, log 100] after every step as
    open_clip does (mlfoundations/open_clip, src/open_clip_train/legacy_train.py at
    89fb801f1e6087880e951fc8354b8a2077b79c6d: ``logit_scale.clamp_(0, math.log(100))`` under ``no_grad`` after each
    optimizer step), with every step sampled; ``pull`` is the gradient's sign and size. ``closure``: the forward
    and backward run inside ``step(closure)``, as Lightning's Trainer runs them."""
    scale = nn.Parameter(torch.tensor([start], dtype=torch.bfloat16))
    opt = wrap(torch.optim.AdamW([scale], lr=lr, weight_decay=0.0))
    monitor = UpdateMonitor([("logit_scale", scale)]).attach(opt.optimizer)
    def forward_backward() -> torch.Tensor:
        opt.zero_grad()
        loss = (scale.float() * pull).sum()
        loss.backward()
        return loss

    for step in range(steps):
        monitor.set_sampling(True)
        if closure:
            opt.step(forward_backward)
        else:
            forward_backward()
            opt.step()
        with torch.no_grad():
            scale.clamp_(0, math.log(100))
        sync(monitor, step)
    monitor.detach()
    opt.detach()
    return monitor


@pytest.mark.parametrize("closure", [False, True], ids=["step()", "step(closure)"])
def test_a_master_reset_to_its_half_copy_before_the_next_step_is_a_lost_update(closure: bool) -> None:
    # log(1 / 0.07) in bf16; AdamW moves it by lr = 1e-3 a step, below half a bf16 ulp (2**-7 here). Inside
    # step(closure) the gradients come after the pre-hook: what the step moved is counted, not what had a gradient
    reset = clamped_temperature(ReloadingMasterWeights, 2.65625, 1.0, closure=closure)
    assert reset.fractions() == {"logit_scale": 1.0} and [f.code for f in reset.findings()] == ["AMP607"]
    assert "fp32 master" in reset.findings()[0].detail and "bfloat16" in reset.findings()[0].detail
    kept = clamped_temperature(MasterWeights, 2.65625, 1.0, closure=closure)
    assert kept.fractions() == {"logit_scale": 0.0} and kept.findings() == []


def test_a_weight_the_clamp_holds_at_its_bound_is_not_a_lost_update() -> None:
    # at log(100)'s bf16 value (4.59375), pushed up by AdamW steps of lr = 2e-2, above half a bf16 ulp (2**-6 here):
    # each step's result rounds past the bound and the clamp writes the bound back. The weight stays where it is,
    # as it would in fp32, but by the user's write, not by rounding: no update was lost.
    held = clamped_temperature(MasterWeights, 4.59375, -1.0, lr=2e-2)
    assert held.fractions() == {"logit_scale": 0.0} and held.findings() == []


def test_without_a_scaler_each_steps_lost_updates_are_in_its_own_record(tmp_path) -> None:
    # The step ends in the watch's optimizer post-hook; the lost-update counts come from a post-hook too. Theirs
    # must run first, or step k's counts land in step k + 1's record and the last ones in a "partial" line.
    from ampdoctor.core.records import read_log, read_recording

    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)  # every bf16 update rounds away
    w = watch(model, opt, every=1, dense=0, log_dir=str(tmp_path))
    for _ in range(3):
        model(torch.randn(8, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    w.detach()
    steps = read_recording(*read_log(tmp_path)[:2]).steps
    assert [(s.step, s.partial) for s in steps] == [(0, False), (1, False), (2, False)]
    assert all(s.lost.fraction == 1.0 and {n: p.fraction for n, p in s.lost.params.items()} == {"weight": 1.0,
               "bias": 1.0} for s in steps)


def test_a_large_parameter_is_sampled_in_runs_and_its_counts_keep_its_name() -> None:
    # "big" (9600 entries) is read as strided runs of 16 and gathered after the small whole ones: its counts must
    # still land on its name. Its lr is tiny (every bf16 update rounds away); the small one's is large (none do).
    torch.manual_seed(0)
    big = nn.Parameter(torch.randn(600, 16, dtype=torch.bfloat16))
    small = nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    opt = torch.optim.SGD([{"params": [big], "lr": 1e-8}, {"params": [small], "lr": 1.0}])
    monitor = UpdateMonitor([("big", big), ("small", small)]).attach(opt)
    for step in range(2):
        monitor.set_sampling(True)
        (big.float().sum() + small.float().pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
        sync(monitor, step)
    assert monitor.with_grad == [2 * 4096, 2 * 8]
    assert monitor.fractions() == {"big": 1.0, "small": 0.0}
    assert [f.where for f in monitor.findings()] == ["big"]


def test_a_parameter_given_new_storage_is_read_from_it() -> None:
    # the sampled entries are kept views of the weights: after ``p.data = ...`` (what MasterWeights does at each
    # phase change) they must come from the new storage, or the step would look as if it moved no weight
    torch.manual_seed(0)
    model = nn.Linear(600, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = UpdateMonitor(list(model.named_parameters())).attach(opt)
    for step in range(3):
        if step == 2:
            model.weight.data = model.weight.data.clone()
        monitor.set_sampling(True)
        model(torch.randn(4, 600)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sync(monitor, step)
    # an fp32 weight: MOVED_SAMPLE entries of the weight, the whole bias
    assert [expected for _, expected, _ in monitor.moved_steps] == [MOVED_SAMPLE + 16] * 3
    assert [moved for _, _, moved in monitor.moved_steps] == [MOVED_SAMPLE + 16] * 3


def test_the_watchs_time_inside_counts_the_lost_update_hooks() -> None:
    # bench/overhead.py's "inside" ratio reads Watch.seconds_inside: the hooks of sampled steps are in it
    model = bf16_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = watch(model, opt, every=1)
    for _ in range(2):
        model(torch.randn(8, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    hooks = w.part("lost_updates").seconds
    w.detach()
    assert hooks > 0 and w.seconds_inside > hooks
