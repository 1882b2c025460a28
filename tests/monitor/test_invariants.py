"""Training-health invariants (``ampdoctor.monitor.invariants``) on real loops: a cause no rule names is still found,
and the all-clear is earned. Each case here ended in "no mixed-precision problems found" (or a false AMP607)
before the invariants; the healthy controls stay quiet."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os

import pytest
import torch
from torch import nn

from ampdoctor.monitor.watcher import Watch, watch
from ampdoctor.ui.cli import main
from ampdoctor.ui.console import render_report

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def run_cli(tmp_path, script: str, *args: str) -> tuple[dict, str]:
    """Run ``ampdoctor run --json`` on a test script; return the report and what was printed (piped)."""
    out, err = io.StringIO(), io.StringIO()
    path = tmp_path / "r.json"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["run", "--json", str(path), os.path.join(SCRIPTS, script), *args]) == 0, err.getvalue()
    return json.loads(path.read_text()), " ".join((out.getvalue() + err.getvalue()).split())


def findings(report: dict, code: str) -> list[dict]:
    return [f for f in report["findings"] if f["code"] == code]


def text_of(w) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(render_report(w.report()))
    return " ".join(console.file.getvalue().split())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def fp16_steps(model: nn.Module, opt, scaler, steps: int, factor: float = 1.0) -> None:
    """The fp16 AMP loop: autocast forward, ``scale(loss).backward()``, ``step``, ``update``; the loss times
    ``factor`` (NaN: every step is skipped)."""
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(torch.randn(8, 16)).float() * factor).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


# ---- progress ------------------------------------------------------------------------------------------------
def test_a_hand_written_scaler_skipping_most_iterations_is_an_error_naming_the_count(tmp_path):
    report, text = run_cli(tmp_path, "hand_loss_scaler.py", "broken")
    [f] = findings(report, "AMP612")
    assert f["severity"] == "error" and f["detail"].startswith("8 of 10 backward calls had gradients that no")
    assert "hand-written loss scaler" in f["detail"] and "stepped 2 times" in f["detail"]
    assert "no mixed-precision problems found" not in text and report["ok"] is False


def test_a_correct_hand_written_scaler_with_a_few_calibration_skips_is_quiet(tmp_path):
    report, text = run_cli(tmp_path, "hand_loss_scaler.py", "healthy")
    assert report["findings"] == []
    assert "ampdoctor: no mixed-precision problems found in 38 steps: 2 of 40 backward calls skipped" in text


def test_a_hand_written_scaler_that_skips_every_iteration_counts_the_last_one_too():
    # docs/rules/examples/AMP612.py: 10 iterations, each skipped; it said "9 of 10 ... dropped" as the last
    # iteration's gradients, left unused when the loop ended, were not counted
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch(model, opt, every=1) as w:
        for _ in range(10):
            opt.zero_grad()
            (model(torch.randn(8, 16)).pow(2).mean() * 2.0**24).backward()
            # the scaler's overflow check fails every time: no opt.step()
    loss = w.summary_data()["loss"]
    assert (loss["backwards"], loss["dropped"], loss["unstepped"], loss["steps_ended"]) == (10, 9, 1, 0)
    [f] = [f for f in w.findings() if f.code == "AMP612"]
    assert f.severity.value == "error" and f.detail.startswith("10 of 10 backward calls")
    assert "the last one had no step after it" in f.detail and "stepped 0 times" in f.detail


def test_a_run_whose_every_step_was_skipped_is_an_error_and_no_all_clear():
    model, scaler = mlp(), torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch(model, opt, scaler, every=1) as w:
        fp16_steps(model, opt, scaler, 6, factor=float("nan"))
    codes = w.report().codes()
    assert "AMP612" in codes and "AMP604" not in codes   # said once, as the error it is
    [f] = [f for f in w.findings() if f.code == "AMP612"]
    assert f.severity.value == "error" and "every one of the 6 optimizer steps was skipped" in f.detail
    assert w.summary_data()["verified"]["ok"] is False and "no mixed-precision problems" not in text_of(w)


def test_a_second_model_optimizer_and_scaler_built_later_are_watched(tmp_path):
    report, _ = run_cli(tmp_path, "resume_stage.py")
    assert [s["steps"] for s in report["watch"]["stages"]] == [5]   # stage 1, then the resumed stage
    assert report["watch"]["steps"] >= 9   # the watch moved to the resumed stage after its STAGE_AFTER-th step
    assert findings(report, "AMP612") and findings(report, "AMP612")[0]["severity"] == "error"


# fp16 with a GradScaler and None gradients raises in scaler.step(): tests/guard/test_scaler_guard.py explains it
@pytest.mark.parametrize(("amp", "set_to_none", "owner"),
                         [(False, True, "opt"), (False, False, "opt"), (True, False, "opt"), (False, True, "model")])
def test_zero_grad_between_backward_and_step_is_amp612_alone(amp: bool, set_to_none: bool, owner: str):
    # every step finds its gradients gone (None) or zeroed: it was AMP617 "never receive a gradient" (None), or
    # nothing at all (zeroed)
    model, scaler = mlp(), torch.amp.GradScaler("cpu", enabled=amp)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    with watch(model, opt, scaler if amp else None, every=1) as w:
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            (opt if owner == "opt" else model).zero_grad(set_to_none=set_to_none)   # wrong place: before the step
            scaler.step(opt)
            scaler.update()
    assert [(f.code, f.where, f.severity.value) for f in w.findings()] == [("AMP612", "training loop", "error")]
    loss, verified = w.summary_data()["loss"], w.summary_data()["verified"]
    assert (loss["dropped"], loss["zeroed_before_step"], loss["steps_ended"]) == (12, 12, 12)
    assert "loss finite and bit-identical on 12 sampled steps" in verified["measured"]   # not "changing"


def test_no_lost_updates_are_counted_on_steps_whose_learning_rate_is_0():
    # the first step of a warmup from 0 (torchtune's default configs): AMP607 fired on it, every entry "lost"
    torch.manual_seed(0)
    model = mlp().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step < 3 else 1.0)
    with watch(model, opt, every=1) as w:
        for _ in range(3):
            model(torch.randn(8, 16, dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    data = w.summary_data()
    assert "AMP607" not in w.report().codes() and "AMP612" not in w.report().codes()
    assert data["lost_updates"]["sampled_steps"] == 0 and data["updates"]["sampled_steps"] == 0


# ---- the loss ------------------------------------------------------------------------------------------------
def test_a_loss_bit_identical_while_the_weights_move_is_found():
    # the loss is summed into a large fp16 offset: at 1000 fp16's ulp is 0.5, so the value never changes, while
    # the gradients flow and Adam moves the weights
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    with watch(model, opt, every=1) as w:
        for _ in range(10):
            loss = (model(x).pow(2).mean() + 1000.0).half()
            loss.backward()
            opt.step()
            opt.zero_grad()
    [f] = [f for f in w.findings() if f.code == "AMP614"]
    assert "the loss was 1000.0 on 10 consecutive sampled steps (0 to 9), bit for bit" in f.detail


def test_a_loss_unchanged_over_a_gradscalers_calibration_skips_is_not_frozen():
    # init_scale=2**30 overflows the fp16 backward: the first 13 steps are skipped, on the same batch the loss is
    # the same bit for bit, and AMP614 said "while the optimizer moved the weights": it had not
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    with watch(model, opt, scaler, every=1) as w:
        for _ in range(20):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    data = w.summary_data()
    assert data["scale"]["skipped_steps"] == list(range(13))
    assert data["loss"]["identical"][:3] == [14, 0, 13]   # the 13 skipped steps and the first that stepped
    assert "AMP614" not in w.report().codes()


def test_a_diverging_loss_is_found_and_a_falling_one_is_not():
    def train(lr: float):
        torch.manual_seed(0)
        model, x = nn.Linear(8, 1), torch.randn(32, 8) * 3
        y = x.sum(1, keepdim=True)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        with watch(model, opt, every=1) as w:
            for _ in range(12):
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        return w

    diverging = [f for f in train(0.25).findings() if f.code == "AMP615"]
    assert diverging and "the loss rose from" in diverging[0].detail
    assert train(0.01).findings() == []


def test_a_non_finite_loss_without_a_scaler_is_an_error():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch(model, opt, every=1) as w:
        for step in range(4):
            x = torch.randn(8, 16)
            x[0, 0] = float("nan") if step == 3 else x[0, 0]
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    codes = {f.code: f for f in w.findings()}
    assert codes["AMP613"].severity.value == "error" and "the last sampled loss is one of them" in \
        codes["AMP613"].detail
    assert codes["AMP616"].severity.value == "error"   # and the step wrote NaN into the weights


# ---- weights, gradients, the clip ----------------------------------------------------------------------------
def test_nan_written_on_a_step_the_scaler_skipped_says_the_update_bypassed_it():
    model, scaler = mlp(), torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch(model, opt, scaler, every=1) as w:
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == 2:
                model[2].bias.grad[0] = float("inf")
            scaler.step(opt)
            if step == 2:
                opt.step()   # the update the scaler skipped, applied anyway
            scaler.update()
            opt.zero_grad()
    [f] = [f for f in w.findings() if f.code == "AMP616"]
    assert f.severity.value == "error" and f.step == 2 and "2.bias" in f.where
    assert "the GradScaler reported step 2 as skipped, so the update bypassed it" in f.detail


def test_trainable_parameters_without_a_gradient_are_named():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.used, self.unused = nn.Linear(16, 8), nn.Linear(8, 1), nn.Linear(8, 1)

        def forward(self, x):
            return self.used(self.body(x))

    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, opt, every=1) as w:
        for _ in range(3):
            model(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    [f] = [f for f in w.findings() if f.code == "AMP617"]
    assert f.severity.value == "info" and f.where == "unused.weight, unused.bias"
    assert "2 of 6 trainable parameters had no gradient on any of the 3 sampled steps" in f.detail


def test_an_optimizer_over_a_replaced_models_tensors_is_no_amp617_and_no_all_clear():
    # the model is re-created after the optimizer was built (a re-run notebook cell): the optimizer steps the first
    # model's tensors, which no longer train; the model's own parameters get gradients but are in no optimizer
    torch.manual_seed(0)
    first = mlp()
    opt = torch.optim.SGD(first.parameters(), lr=1e-2)
    model = mlp()
    with watch(model, opt, every=1) as w:
        for _ in range(3):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert "AMP617" not in [f.code for f in w.findings()]   # was: "none of the 4 trainable parameters ..."
    arrival = w.summary_data()["gradients"]["arrival"]
    assert (arrival["params"], arrival["without"], arrival["outside"]) == (0, [], 4)
    assert any("4 tensors the optimizer steps" in m for m in w.summary_data()["verified"]["not_measured"])
    assert "no mixed-precision problems found" not in text_of(w)


def test_a_watch_that_follows_a_replaced_model_names_none_of_its_parameters():
    # `ampdoctor run` hands the watch the model that owns the optimizer's tensors: here the previous fold's, which
    # no longer runs; the fold's new model trains (its parameters in no optimizer)
    old, new = mlp(), mlp()
    opt = torch.optim.SGD(old.parameters(), lr=1e-2)
    with Watch(old, opt, every=1, others=[old, new]) as w:
        for _ in range(3):
            new(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert "AMP617" not in [f.code for f in w.findings()]   # was: 0.weight, 0.bias, ... "nothing trains"
    assert w.summary_data()["gradients"]["arrival"]["outside"] == 4


def test_a_model_whose_forward_ran_and_whose_parameters_got_no_gradient_is_still_amp617():
    # the positive control: the optimizer was built over the teacher, whose forward runs (under no_grad) while
    # the student's loss is what backward sees: the teacher's parameters really never get a gradient
    teacher, student = mlp(), mlp()
    opt = torch.optim.SGD(teacher.parameters(), lr=1e-2)
    with watch(teacher, opt, every=1) as w:
        for _ in range(3):
            x = torch.randn(8, 16)
            with torch.no_grad():
                target = teacher(x)
            (student(x) - target).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    [f] = [f for f in w.findings() if f.code == "AMP617"]
    assert f.severity.value == "error" and f.where == "model"


@pytest.mark.parametrize("mode", ["cell", "kfold"])
def test_ampdoctor_run_names_no_amp617_for_a_replaced_models_tensors(tmp_path, mode):
    report, _ = run_cli(tmp_path, "stale_optimizer.py", mode)
    assert findings(report, "AMP301") and not findings(report, "AMP617")
    healthy, text = run_cli(tmp_path, "stale_optimizer.py", "right")
    assert healthy["findings"] == [] and "no mixed-precision problems found in 12 steps" in text


def test_a_clip_over_a_filter_the_optimizer_consumed_is_found_and_the_list_is_quiet(tmp_path):
    report, _ = run_cli(tmp_path, "clip_filter.py", "filter", "0.01")
    [f] = findings(report, "AMP618")
    assert "returned a total norm of 0 on 10 of 10 sampled steps" in f["detail"]
    assert not findings(report, "AMP611")   # it clipped nothing: "every step was clipped" would be false
    fixed, _ = run_cli(tmp_path, "clip_filter.py", "list", "0.01")
    assert not findings(fixed, "AMP618") and findings(fixed, "AMP611")   # now it clips every step


# ---- the all-clear -------------------------------------------------------------------------------------------
def test_the_all_clear_says_what_was_verified_and_the_json_carries_it():
    model, scaler = mlp(), torch.amp.GradScaler("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, opt, scaler, every=5) as w:
        fp16_steps(model, opt, scaler, 20)
    text = text_of(w)
    assert ("ampdoctor: no mixed-precision problems found in 20 steps: 20 updated, 0 skipped by the GradScaler; "
            "weights moved on 12 of 12 sampled steps and stayed finite; loss finite and changing on 12 sampled "
            "steps; gradients reached 4 of 4 trainable parameters; 8 steps not sampled") in text
    assert w.summary_data()["verified"]["ok"] is True and w.summary_data()["verified"]["not_measured"] == []


def test_the_all_clear_counts_only_the_steps_the_grad_scaler_took():
    # a GradScaler created and never used: the 5 steps were not its to update or skip
    model, scaler = mlp(), torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch(model, opt, scaler, every=1) as w:
        for _ in range(5):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert "no mixed-precision problems found in 5 steps: weights moved on 5 of 5 sampled steps" in text_of(w)
    assert not any("GradScaler" in m for m in w.summary_data()["verified"]["measured"])


def test_an_unmeasured_loss_is_no_all_clear():
    # gradients computed by torch.autograd.grad, assigned by hand: no backward for the loss
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with watch(model, opt, every=1) as w:
        for _ in range(3):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            for p, g in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
                p.grad = g
            opt.step()
            opt.zero_grad()
    text = text_of(w)
    assert "not measured: the loss (no backward seen); so this is no all-clear" in text
    assert "no mixed-precision problems found" not in text


def test_the_invariants_add_no_host_read_on_steps_that_are_not_sampled():
    def syncs(extra_steps: int) -> int:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with watch(model, opt, every=50, dense=0) as w:
            for _ in range(1 + extra_steps):
                model(torch.randn(8, 16)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return w.host_syncs

    assert syncs(0) == syncs(40)   # step 0 is sampled; steps 1..40 are not


def test_a_monitored_run_trains_bitwise_the_same():
    def train(watched: bool):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with (watch(model, opt, every=1) if watched else contextlib.nullcontext()):
            for step in range(5):
                torch.manual_seed(step)
                model(torch.randn(8, 16)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return copy.deepcopy(model.state_dict())

    a, b = train(False), train(True)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("n", [1])
def test_fsdp2_fp16_parameters_keep_the_update_meter_on(tmp_path, n):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no process group yet")
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=n)
    try:
        model = mlp().half()
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with watch(model, opt, every=1) as w:
            for _ in range(3):
                model(torch.randn(8, 16, dtype=torch.float16)).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        dist.destroy_process_group()
    assert [f.detail for f in w.findings() if f.code == "AMP001"] == []   # was: index_select got mixed DTensor
    assert w.summary_data()["lost_updates"]["sampled_steps"] == 3


# ---- AMP610: every loss, where the run's log hides the inf/NaN ones ------------------------------------------------
def _loss_at(step: int, bad_step: int | None, model: nn.Module) -> torch.Tensor:
    loss = model(torch.randn(8, 16)).pow(2).mean()
    # a NaN value with finite gradients: the loss the log would average away, the weights stay finite
    return loss + torch.tensor(float("nan")) if step == bad_step else loss


@pytest.mark.parametrize("counted", [True, False])
def test_amp610_counts_the_nan_loss_of_a_step_that_was_not_sampled(counted):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with watch(model, opt, every=50) as w:   # samples steps 0-9, then 50: step 20 is not sampled
        if counted:
            w.count_every_loss("TrainingArguments(logging_nan_inf_filter=True)")
        for step in range(30):
            _loss_at(step, 20, model).backward()
            opt.step()
            opt.zero_grad()
    summary = w.summary_data()
    assert summary["loss"]["nonfinite"] == []   # no sampled loss was NaN: only every loss sees it
    hidden = [f for f in w.findings() if f.code == "AMP610"]
    if counted:
        [finding] = hidden
        assert (finding.where, finding.step) == ("TrainingArguments(logging_nan_inf_filter=True)", 20)
        assert "1 of 30 training losses" in finding.detail
    else:
        assert hidden == [] and "every" not in summary["loss"]


def test_amp610_quiet_when_every_loss_is_finite():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with watch(model, opt, every=50) as w:
        w.count_every_loss("TrainingArguments(logging_nan_inf_filter=True)")
        for step in range(12):
            _loss_at(step, None, model).backward()
            opt.step()
            opt.zero_grad()
    assert "AMP610" not in [f.code for f in w.findings()]
    assert w.summary_data()["loss"]["every"] == {"losses": 12, "nonfinite": 0, "first": None,
                                                 "hidden_by": "TrainingArguments(logging_nan_inf_filter=True)"}
