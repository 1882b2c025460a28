"""AMP409's severity (guard/checks.py) on real GradScaler("cpu") loops with real torch LR schedulers.

The guard reports AMP409 once per place, counted; these tests measure what the guard's observers would see (the
learning rates before and after each ``scheduler.step()``, the skipped iterations) and check the severity that
the counts and the learning-rate drift earn.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ampdoctor.core.findings import Severity
from ampdoctor.core.training import TrainingSetup
from ampdoctor.guard.checks import (
    escalated_finding,
    lr_change,
    lr_values,
    schedule_length,
    scheduler_finding,
    scheduler_severity,
)
from ampdoctor.guard.scaler_guard import ScalerGuard

HUGE = 1e36   # times a scale of 65536 overflows fp32 (max 3.4e38): the scaler finds inf and skips the step


def run(steps: int, skip_at: set[int], make_scheduler) -> tuple[list, int, float, float]:
    """Train an MLP under fp16 autocast with a GradScaler and ScalerGuard; step the scheduler every iteration.

    Return the guard's findings, the iterations whose optimizer step was skipped with the schedule advancing,
    the product of the learning-rate changes those scheduler steps made, and the final learning rate.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    sched = make_scheduler(opt)
    skipped, factor = 0, 1.0
    with ScalerGuard(scaler, TrainingSetup(model, opt, scaler)) as guard:
        for i in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean() * (HUGE if i in skip_at else 1.0)
            scaler.scale(loss).backward()
            before_scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            before = lr_values(opt)
            sched.step()                                  # every iteration, skipped or not
            if scaler.get_scale() < before_scale:         # this iteration's optimizer step was skipped
                skipped += 1
                factor *= lr_change(before, lr_values(opt))
            opt.zero_grad()
    return guard.findings(), skipped, factor, opt.param_groups[0]["lr"]


def test_a_run_that_never_trained_while_steplr_halved_the_lr_is_a_warning() -> None:
    # Was info: 6 of 6 optimizer steps skipped, and StepLR(gamma=0.5) halved the learning rate on each of them.
    findings, skipped, factor, lr = run(6, set(range(6)), lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    amp409 = [f for f in findings if f.code == "AMP409"]
    assert [f.where for f in amp409] == ["StepLR on optimizer[0] (SGD)"]
    assert skipped == 6 and factor == 2.0**-6 and lr == 0.1 * 2.0**-6
    assert amp409[0].severity is Severity.WARNING       # the guard's own finding, counted over the run
    assert "6 of 6 iterations" in amp409[0].detail and "x0.0156" in amp409[0].detail
    built = scheduler_finding("StepLR", "optimizer[0] (SGD)", "train.py:12", 5, skipped=6, iterations=6,
                               lr_factor=factor)
    assert built.severity is Severity.WARNING and built.code == "AMP409"


def test_all_skipped_is_a_warning_even_when_the_lr_does_not_move() -> None:
    findings, skipped, factor, _ = run(6, set(range(6)), lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0))
    assert skipped == 6 and factor == 1.0
    amp409 = next(f for f in findings if f.code == "AMP409")
    assert amp409.severity is Severity.WARNING and escalated_finding(amp409, skipped, 6, factor) is amp409


def test_a_few_calibration_skips_under_a_long_cosine_schedule_stay_info() -> None:
    findings, skipped, factor, _ = run(
        40, {0, 1}, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10_000))
    assert skipped == 2 and math.isclose(factor, 1.0, rel_tol=1e-6)
    amp409 = next(f for f in findings if f.code == "AMP409")
    assert amp409.severity is Severity.INFO and escalated_finding(amp409, skipped, 40, factor).severity is Severity.INFO
    assert scheduler_finding("CosineAnnealingLR", "opt", "t.py:1", 1, skipped=2, iterations=40,
                              lr_factor=factor).severity is Severity.INFO


def test_one_skipped_steplr_decay_that_halves_the_lr_is_a_warning() -> None:
    # StepLR(step_size=1, gamma=0.5): one calibration skip at iteration 0 leaves every later LR at half its schedule
    findings, skipped, factor, _ = run(40, {0}, lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    assert skipped == 1 and factor == 0.5
    amp409 = next(f for f in findings if f.code == "AMP409")
    assert amp409.severity is Severity.WARNING and "x0.5" in amp409.detail


def test_severity_thresholds() -> None:
    assert scheduler_severity(1, 1) is Severity.INFO          # one skip is never "most steps"
    assert scheduler_severity(2, 4) is Severity.WARNING       # half
    assert scheduler_severity(2, 5) is Severity.INFO
    assert scheduler_severity(1, 100, 1.9) is Severity.INFO
    assert scheduler_severity(1, 100, 2.0) is Severity.WARNING  # warmup pushed ahead: the LR doubled
    assert scheduler_severity(1, 100, 0.0) is Severity.WARNING


def test_lr_values_skip_what_would_need_a_device_read() -> None:
    model = nn.Linear(2, 2)
    assert lr_values(torch.optim.SGD(model.parameters(), lr=0.5)) == [0.5]
    assert lr_values(torch.optim.Adam(model.parameters(), lr=torch.tensor(0.5))) == [0.5]  # a CPU tensor: no sync
    assert lr_values(object()) is None
    assert lr_change([0.1, 0.2], [0.1, 0.8]) == 4.0 and lr_change([0.1], [0.1, 0.2]) == 1.0


# ---- AMP409 against the schedule's length ------------------------------------------------------------------------

def linear_warmup(steps: int):
    return lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, s / steps))


def test_a_correct_linear_warmup_with_three_calibration_skips_is_info() -> None:
    # Was a warning: the warmup's LR moved from 0 to 0.03 over the skipped steps 0-2 (x2 then x1.5 after the first).
    # The schedule only runs 3 steps ahead of the weights; after the warmup the LR is what it would have been.
    findings, skipped, _, lr = run(60, {0, 1, 2}, linear_warmup(10))
    assert skipped == 3 and lr == 0.1
    amp409 = next(f for f in findings if f.code == "AMP409")
    assert amp409.severity is Severity.INFO


def test_transformers_linear_schedule_a_few_skips_of_its_length_is_info() -> None:
    from transformers import get_linear_schedule_with_warmup

    findings, skipped, _, _ = run(60, {0, 1, 2}, lambda o: get_linear_schedule_with_warmup(o, 10, 60))
    assert skipped == 3   # 5% of the 60-step schedule
    assert next(f for f in findings if f.code == "AMP409").severity is Severity.INFO


def test_transformers_linear_schedule_skipping_a_tenth_of_its_length_is_a_warning() -> None:
    from transformers import get_linear_schedule_with_warmup

    findings, skipped, _, _ = run(60, set(range(8)), lambda o: get_linear_schedule_with_warmup(o, 10, 60))
    assert skipped == 8
    amp409 = next(f for f in findings if f.code == "AMP409")
    assert amp409.severity is Severity.WARNING
    assert "8 skipped optimizer steps, 13% of its 60 steps" in amp409.detail


def test_a_plain_warmup_lambda_whose_length_is_unknown_warns_when_most_steps_were_skipped() -> None:
    findings, skipped, _, _ = run(40, set(range(24)), linear_warmup(10))
    assert skipped == 24
    amp409 = next(f for f in findings if f.code == "AMP409")
    assert amp409.severity is Severity.WARNING and "24 of 40 iterations" in amp409.detail


def test_a_short_cosine_schedule_warns_when_the_skips_are_a_tenth_of_t_max() -> None:
    findings, _, _, _ = run(40, {0, 1, 2, 3}, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40))
    assert next(f for f in findings if f.code == "AMP409").severity is Severity.WARNING


def test_schedule_length() -> None:
    from diffusers.optimization import get_scheduler
    from transformers import get_cosine_schedule_with_warmup

    sched = torch.optim.lr_scheduler
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert schedule_length(sched.CosineAnnealingLR(opt, T_max=60)) == 60
    assert schedule_length(sched.OneCycleLR(opt, max_lr=0.1, total_steps=80)) == 80
    assert schedule_length(sched.PolynomialLR(opt, total_iters=30)) == 30
    assert schedule_length(sched.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=50)) == 50
    assert schedule_length(sched.LinearLR(opt, start_factor=0.1, total_iters=10)) is None   # a warmup that holds
    assert schedule_length(sched.StepLR(opt, 5)) is None
    assert schedule_length(sched.LambdaLR(opt, lambda s: min(1.0, s / 10))) is None
    assert schedule_length(get_cosine_schedule_with_warmup(opt, 10, 70)) == 70                   # functools.partial
    assert schedule_length(get_scheduler("linear", opt, num_warmup_steps=10, num_training_steps=90)) == 90  # closure


def test_severity_against_the_length() -> None:
    assert scheduler_severity(3, 60, 4.0, length=60) is Severity.INFO      # the LR drift of a warmup is transient
    assert scheduler_severity(6, 60, length=60) is Severity.WARNING        # 10%
    assert scheduler_severity(5, 60, length=60) is Severity.INFO
    assert scheduler_severity(2, 4, length=10_000) is Severity.INFO        # most iterations, but 0.02% of the schedule
