"""ScaleMonitor on real GradScaler("cpu") loops with fused, foreach and for-loop AdamW."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.core.words import scale_text
from ampdoctor.explanations.fixes import scale_collapse_fix
from ampdoctor.monitor.loss_scale import ScaleMonitor

KINDS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def sync(monitor: ScaleMonitor) -> dict:
    """The owner's one sync: device tensors to host lists, handed back."""
    return monitor.consume({k: v.reshape(-1).tolist() for k, v in monitor.pending().items()})


def train(kind: str, steps: int, inf_at: set[int], monitor_every: int = 4, **scaler_kw: float):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **KINDS[kind])
    scaler = torch.amp.GradScaler("cpu", **scaler_kw)
    monitor = ScaleMonitor(scaler, capacity=2).attach()
    records = []
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 6)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step in inf_at:
            model[2].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step % monitor_every == monitor_every - 1:
            records.append(sync(monitor))
    records.append(sync(monitor))
    monitor.detach()
    return monitor, records, scaler


@pytest.mark.parametrize("kind", list(KINDS))
def test_skipped_steps_are_counted_with_every_adamw_implementation(kind: str) -> None:
    monitor, records, scaler = train(kind, 13, {2, 5, 6, 11})
    assert monitor.steps == 13
    assert monitor.skipped == 4
    assert monitor.skipped_steps == [2, 5, 6, 11]
    assert [s for r in records for s in r["skipped"]] == [2, 5, 6, 11]
    assert monitor.longest_run == (2, 5)
    # the scale used halves after each skipped step, and nothing else changes it within 13 steps
    assert monitor.history == [(0, 65536.0), (3, 32768.0), (6, 16384.0), (7, 8192.0), (12, 4096.0)]
    assert monitor.current_scale == scaler.get_scale() == 4096.0
    assert monitor.findings() == []  # two in a row is below the alarm


def test_consecutive_skips_raise_amp604_and_warmup_needs_a_longer_run() -> None:
    monitor, _, _ = train("foreach", 10, {4, 5, 6})
    assert [f.code for f in monitor.findings()] == ["AMP604"]
    assert monitor.findings()[0].step == 4
    assert "3 consecutive" in monitor.findings()[0].detail
    warmup, _, _ = train("foreach", 10, {0, 1, 2, 3, 4})  # calibration from 2**16: tolerated up to 7
    assert warmup.findings() == []


def test_more_than_five_percent_skipped_raises_amp604() -> None:
    monitor, _, _ = train("for-loop", 100, set(range(0, 100, 15)), monitor_every=50)
    assert monitor.skipped == 7
    assert [f.code for f in monitor.findings()] == ["AMP604"]  # the scale fell by 2**7 only: no collapse
    assert "7 of 100" in monitor.findings()[0].detail


def overflowing_forward(steps: int = 12) -> ScaleMonitor:
    """A Linear whose fp16 output overflows 65504 on every step (3e4 * 4 = 1.2e5): the loss's gradient is inf, every
    step is skipped and the scale halves, step after step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(3e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with ScaleMonitor(scaler) as monitor:
        for step in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.ones(2, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if step == 6:
                sync(monitor)
                assert "AMP603" not in [f.code for f in monitor.findings()]  # 2**16 -> 2**9: not yet 2**8 down
        sync(monitor)
    return monitor


def test_a_collapse_raises_amp603_and_places_the_inf_nan_nowhere_when_no_forward_was_looked_at() -> None:
    monitor = overflowing_forward()
    assert [f.code for f in monitor.findings()] == ["AMP604", "AMP603"]
    collapse = monitor.findings()[1]
    assert monitor.current_scale == 2.0**4 and "to 16 after step 11" in collapse.detail
    # alone, the monitor saw no forward: it says neither "forward pass" nor "backward pass" happened
    assert monitor.origin() is None and collapse.fix is None
    assert "forward pass already" not in collapse.detail and "arise in the backward" not in collapse.detail


def test_a_collapse_names_the_forward_only_when_a_skipped_steps_forward_showed_the_module() -> None:
    monitor = overflowing_forward()
    monitor.note_forward("0", float("inf"))   # what the watch's look at a skipped step's forward saw
    monitor.name_culprit("0 (Linear)")
    collapse = monitor.findings()[1]
    assert monitor.origin() == "forward" and collapse.fix is None   # the rule's fix: upcast the module
    assert "First module with a non-finite output: 0 (Linear)" in collapse.detail
    monitor.note_forward(None, 1.5)   # another skipped step whose outputs and loss were finite
    assert "on 1 of the 2 skipped steps" in monitor.findings()[1].detail


@pytest.mark.parametrize(("module", "loss", "origin"), [
    (None, 0.25, "backward"), (None, float("nan"), "loss"), (None, None, "outputs"), ("(input)", None, "forward")])
def test_a_collapse_with_a_finite_forward_says_so_and_blames_no_module(module, loss, origin) -> None:
    monitor = overflowing_forward()
    monitor.note_forward(module, loss)
    monitor.name_culprit("0 (Linear)")   # an AMP601 of another step names no culprit for these
    collapse = monitor.findings()[1]
    assert monitor.origin() == origin
    assert "First module with a non-finite output" not in collapse.detail
    assert (collapse.fix is None) == (origin == "forward")   # no module to upcast: the fix that fits


def test_scale_below_one_is_a_collapse() -> None:
    monitor, _, _ = train("foreach", 4, {0, 1, 2}, init_scale=4.0)
    assert monitor.current_scale == 0.5
    assert "AMP603" in [f.code for f in monitor.findings()]


def test_buffer_grows_between_syncs_and_stays_on_the_device() -> None:
    monitor, records, _ = train("foreach", 9, set(), monitor_every=100)  # one sync for 9 steps, capacity 2
    assert records[-1]["steps"] == [0, 9]
    assert monitor.steps == 9


def test_detach_restores_the_scaler_and_drops_it() -> None:
    scaler = torch.amp.GradScaler("cpu")
    before = dict(vars(scaler))
    monitor = ScaleMonitor(scaler).attach()
    assert "update" in vars(scaler)
    monitor.detach()
    assert vars(scaler) == before
    assert monitor._scaler is None


def test_a_failing_update_is_not_counted() -> None:
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones((), requires_grad=True))
    with ScaleMonitor(scaler) as monitor:
        with pytest.raises(AssertionError, match="No inf checks"):
            scaler.update()
        assert sync(monitor)["steps"] == [0, 0]


def test_rejects_something_that_is_not_a_scaler() -> None:
    with pytest.raises(TypeError, match="must be a torch.amp.GradScaler"):
        ScaleMonitor(object())


def test_calibration_from_a_high_init_scale_then_a_settled_scale_is_no_collapse() -> None:
    # 2**40 overflows the fp16 backward until the scale is down to about 2**19: 21 skips from step 0, then clean
    # steps at a stable scale. The old rule (peak / current >= 2**8) called that a collapse at the first sync.
    monitor, records, scaler = train("foreach", 60, set(), monitor_every=10, init_scale=2.0**40)
    assert monitor.longest_run[1] == 0 and monitor.longest_run[0] >= 15  # calibration from step 0
    assert monitor.peak[1] / monitor.current_scale >= 2.0**8
    assert monitor.run == 0 and monitor.skipped == monitor.longest_run[0]  # settled: nothing skipped since
    assert "AMP603" not in [f.code for f in monitor.findings()]
    assert monitor.reference == monitor.succeeded and monitor.succeeded[1] == monitor.current_scale


def test_growth_and_backoff_at_a_settled_scale_is_no_collapse() -> None:
    # growth_interval=1: the scale doubles after every clean step and halves on the overflow that follows, so a
    # sync often lands right after a skip, far below the 2**40 peak; the scale is not falling.
    monitor, _, _ = train("for-loop", 80, set(), monitor_every=3, init_scale=2.0**40, growth_interval=1)
    assert monitor.skipped > monitor.longest_run[0] + 10  # skips after the calibration, one at a time
    assert "AMP603" not in [f.code for f in monitor.findings()]


def test_an_intermittent_collapse_after_clean_steps_is_amp603() -> None:
    # 20 clean steps at 2**16, then every step but one in four has an inf gradient: the scale keeps halving.
    inf_at = {s for s in range(20, 60) if s % 4}
    monitor, _, _ = train("foreach", 60, inf_at, monitor_every=5)
    assert monitor.succeeded[1] == 2.0**16
    finding = next(f for f in monitor.findings() if f.code == "AMP603")
    assert "65536 (step 0, the highest a step succeeded with)" in finding.detail
    assert monitor.current_scale < 2.0**8


def test_a_long_calibration_from_a_large_init_scale_is_info_and_a_later_run_still_warns() -> None:
    # init_scale 2**40: the fp16 backward overflows until the scale has halved some 25 times; then it trains.
    # That cost the first steps (info, with the init_scale that would have saved them), it is not trouble.
    monitor, _, scaler = train("foreach", 40, set(), monitor_every=7, init_scale=2.0**40)
    (calibration,) = monitor.findings()
    length = monitor.warmup[0]
    assert calibration.code == "AMP604" and calibration.severity.value == "info" and length >= 8
    assert monitor.skipped_steps == list(range(length))
    assert f"the first {length} optimizer steps were skipped" in calibration.detail
    assert f"from {scale_text(2.0**40)} down to {scale_text(monitor.scale_at(length))}" in calibration.detail
    assert "AMP603" not in [f.code for f in monitor.findings()]
    # the same calibration, then 3 skips in a row at steps 32-34: a warning about those, not about the start
    later, _, _ = train("foreach", 40, {32, 33, 34}, monitor_every=7, init_scale=2.0**40)
    (run,) = later.findings()
    assert (run.code, run.severity.value, run.step) == ("AMP604", "warning", 32)
    assert run.detail.startswith("3 consecutive optimizer steps skipped from step 32")


def test_the_amp604_detail_has_the_counts_of_the_whole_run_not_those_at_detection() -> None:
    # 3 skips in a row at steps 4-6 are detected at the sync after step 7; 2 more skips follow
    monitor, _, _ = train("foreach", 16, {4, 5, 6, 10, 13}, monitor_every=8)
    (finding,) = monitor.findings()
    assert "5 of 16 steps skipped in all" in finding.detail


def test_every_step_skipped_from_the_start_warns_while_it_lasts() -> None:
    monitor, _, _ = train("foreach", 9, set(range(9)), init_scale=2.0**10)
    codes = [(f.code, f.severity.value) for f in monitor.findings()]
    assert ("AMP604", "warning") in codes
    assert "every optimizer step skipped since step 0, 9 so far" in monitor.findings()[0].detail


SQRT_OF_ZERO = Path(__file__).parents[1] / "scripts" / "sqrt_of_zero.py"


def test_a_collapse_that_no_scale_explains_is_not_told_to_train_in_bf16(tmp_path):
    import json

    from ampdoctor.ui.cli import main

    out = tmp_path / "r.json"
    assert main(["run", "--json", str(out), str(SQRT_OF_ZERO)]) == 0
    [amp603] = [f for f in json.loads(out.read_text())["findings"] if f["code"] == "AMP603"]
    detail = " ".join(amp603["detail"].split())
    assert "stayed down to a loss scale of 1.14e-13" in detail and "the scale is not the cause" in detail
    code = [line for line in amp603["fix"].splitlines() if not line.startswith("#")]
    assert code[0] == "ampdoctor.watch(model, opt, scaler, activations=True)"   # find the op first
    assert "bfloat16" not in amp603["fix"].split("\n# an fp16 op")[0]   # not before the sqrt(0) case
    # the same fall, with the fp16 overflow at a scale that still could: the bf16 fix stays (the rule's case)
    assert scale_collapse_fix("backward").splitlines()[1].endswith("train in bf16 (fp32's range):")
