"""The loss scalers libraries write for themselves (fairseq's, DeepSpeed's, apex's, Megatron-LM's), by their texts and
their effects: the watch counts their skipped steps and reads their scale into the loss scale's one history (the
``loss scale ...`` line, AMP603, AMP604, AMP612), and the crash they end a run with is explained (AMP603).

fairseq does not install here and DeepSpeed refuses fp16 on a CPU, so their scalers are re-created in our own words
with the same class names, attributes and exceptions, each citing the file and commit it follows:

* fairseq: ``tests/scripts/fairseq_loss_scaler.py`` (facebookresearch/fairseq 3d262bb25690e4eb2e7d3c1309b1e9c406ca4b99,
  ``fairseq/optim/dynamic_loss_scaler.py``, ``fairseq/optim/fp16_optimizer.py``, ``fairseq/trainer.py``);
* DeepSpeed: `DynamicLossScaler` below (deepspeedai/DeepSpeed edaa7221267243c7be7fb49c5d5f5c4fb97b4641,
  ``deepspeed/runtime/fp16/loss_scaler.py``, used by ``deepspeed/runtime/zero/stage_1_and_2.py``); the real class is
  also recognised where DeepSpeed is installed;
* apex and Megatron-LM: the shapes of NVIDIA/apex e13873debc4699d39c6861074b9a3b2a02327f92 ``apex/amp/scaler.py`` and
  NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553 ``megatron/core/optimizer/grad_scaler.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os

import pytest
import torch
from torch import nn

from ampdoctor.explanations.crash import explain_exception
from ampdoctor.monitor.loss_scale import ScaleMonitor
from ampdoctor.monitor.watcher import watch
from ampdoctor.ui.cli import main

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "fairseq_loss_scaler.py")
_spec = importlib.util.spec_from_file_location("fairseq_loss_scaler", SCRIPT)
fairseq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fairseq)   # defines the scaler and the loop; trains only as __main__

FAIRSEQ_TEXT = ("FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding. Try "
                "lowering the learning rate, using gradient clipping or increasing the batch size.")
FAIRSEQ_AMP_TEXT = ("FloatingPointError: AMP: Minimum loss scale reached (0.0001). Your loss is probably exploding. "
                    "Try lowering the learning rate, using gradient clipping or increasing the batch size.")
DEEPSPEED_TEXT = "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


def run_cli(tmp_path, *args: str) -> tuple[int, dict, str]:
    """Run ``ampdoctor run --json`` on the fairseq script; return the exit status, the report and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    path = tmp_path / "r.json"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", "--json", str(path), SCRIPT, *args])
    return code, json.loads(path.read_text()), " ".join((out.getvalue() + err.getvalue()).split())


def found(report: dict, code: str) -> list[dict]:
    return [f for f in report["findings"] if f["code"] == code]


# ---- fairseq ---------------------------------------------------------------------------------------------------
def test_a_fairseq_scaler_that_reaches_its_minimum_is_explained_and_its_collapse_counted(tmp_path):
    # `--fp16 --lr 3.0`: 21 steps skipped while the scale fell from 128, then "Minimum loss scale reached (0.0001)"
    code, report, text = run_cli(tmp_path, "exploding")
    assert code == 1 and report["exception"]["type"] == "FloatingPointError"
    assert "not a known mixed-precision failure" not in text and "AMP603" in report["explained_by"]
    crash, collapse = found(report, "AMP603")
    assert crash["where"].startswith("DynamicLossScaler (fairseq) at fairseq_loss_scaler.py:")
    assert "reached its minimum (0.0001; the last scale tried: 0.000122)" in crash["detail"]
    assert "--min-loss-scale" in crash["fix"] and "--bf16" in crash["fix"]
    assert collapse["where"] == "DynamicLossScaler (fairseq)" and "fell from 128" in collapse["detail"]
    scale = report["watch"]["scale"]
    assert (scale["steps"], scale["skipped"], scale["scaler"]) == (23, 21, "DynamicLossScaler (fairseq)")
    assert scale["history"][0] == [0, 128.0] and scale["current"] == 2.0**-13
    assert "loss scale 0.000122 (peak 128 at step 0, lowest 0.000122); skipped 21 of 23 steps" in text
    assert found(report, "AMP604")[0]["where"] == "DynamicLossScaler (fairseq)"
    assert not [f for f in found(report, "AMP612") if f["where"] == "training loop"]   # the skips, said once


def test_a_healthy_run_with_the_same_scaler_is_quiet(tmp_path):
    code, report, text = run_cli(tmp_path, "healthy")
    assert code == 0 and report["findings"] == []
    scale = report["watch"]["scale"]
    assert (scale["steps"], scale["skipped"], scale["current"]) == (40, 0, 128.0)
    assert "no mixed-precision problems found in 40 steps" in text


def test_the_watch_reads_a_fairseq_scaler_and_changes_nothing():
    data = torch.randn(12, 32, 16, generator=torch.Generator().manual_seed(0)).half()

    def run(watched: bool) -> tuple[list[bool], list[torch.Tensor], object, object]:
        model, master, opt, scaler = fairseq.build("exploding")
        with watch(model, opt, scaler, every=1) if watched else contextlib.nullcontext() as w:
            stepped = [fairseq.train_step(model, master, opt, scaler, x) for x in data]
        return stepped, master, scaler, w

    plain, plain_master, plain_scaler, _ = run(False)
    stepped, master, scaler, w = run(True)
    skips = plain.count(False)   # each halves the scale from 128; lr=3.0 keeps the gradients inf after the first
    assert stepped == plain and skips > 8 and scaler.loss_scale == plain_scaler.loss_scale == 128.0 / 2**skips
    assert vars(scaler).keys() == vars(plain_scaler).keys()   # the observer is gone: check_overflow is the class's
    assert all(torch.equal(a, b) for a, b in zip(master, plain_master))
    section = w.summary_data()["scale"]
    assert section["skipped_steps"] == [k for k, ok in enumerate(stepped) if not ok]
    assert (section["steps"], w.steps, section["current"]) == (12, 12, scaler.loss_scale)
    assert [v for _, v in section["history"]] == [128.0 / 2**k for k in range(skips)]   # the last one is not used
    codes = {(f.code, f.where) for f in w.findings()}
    assert ("AMP603", "DynamicLossScaler (fairseq)") in codes and ("AMP604", "DynamicLossScaler (fairseq)") in codes
    assert not any(code == "AMP612" for code, _ in codes)   # the skipped iterations are no dropped backward calls


# ---- DeepSpeed ---------------------------------------------------------------------------------------------------
class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler (``deepspeed/runtime/fp16/loss_scaler.py``, see the module docstring): the
    names ZeRO's optimizer reads, the hysteresis that skips a step without lowering the scale, and the exception at
    ``min_scale``. Logging and ranks are left out."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_factor, self.scale_window, self.min_scale = 2.0, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.dynamic = True

    @property
    def loss_scale(self):
        return self.cur_scale

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. "
                                    "Exiting run.")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1   # skipped, but the scale stays
            self.last_overflow_iter = self.cur_iter
        else:
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                self.cur_scale *= self.scale_factor
                self.cur_hysteresis = self.delayed_shift
        self.cur_iter += 1


def zero_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: DynamicLossScaler, x: torch.Tensor) -> bool:
    """One step as ZeRO's ``step()`` takes it: the scaled backward, the overflow check, ``update_scale(overflow)``,
    and no optimizer step on an overflow; return whether the optimizer stepped."""
    opt.zero_grad()
    (model(x).float().pow(2).mean() * scaler.loss_scale).backward()
    overflow = any(not torch.isfinite(p.grad).all() for p in model.parameters())
    scaler.update_scale(overflow)
    if overflow:
        return False
    for p in model.parameters():
        p.grad.div_(scaler.cur_scale)
    opt.step()
    return True


def test_every_skip_of_a_deepspeed_scaler_is_counted_also_those_that_keep_the_scale():
    # hysteresis 2: the first overflow of a run skips the step and keeps the scale; counting the falls of the scale
    # would miss it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**4, scale_window=1000, min_scale=1.0, delayed_shift=2)
    batches = [torch.randn(4, 8) for _ in range(8)]
    for k in (2, 3, 4):
        batches[k][0, 0] = float("inf")   # an inf input: these steps overflow at any scale
    with watch(model, opt, scaler, every=1) as w:
        stepped = [zero_step(model, opt, scaler, x) for x in batches]
    section = w.summary_data()["scale"]
    assert stepped.count(False) == 3 and section["skipped_steps"] == [2, 3, 4]
    assert [v for _, v in section["history"]] == [16.0, 8.0, 4.0]   # two falls for three skips
    assert section["scaler"] == "DynamicLossScaler (DeepSpeed)" and w.steps == 8


def test_a_deepspeed_scaler_at_its_minimum_is_explained_with_deepspeeds_settings():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0, scale_window=1000, min_scale=1.0, delayed_shift=1)
    x = torch.full((2, 4), float("nan"))
    with pytest.raises(Exception, match="already at minimum") as raised:
        for _ in range(3):
            zero_step(model, opt, scaler, x)
    [f] = explain_exception(raised.value)
    assert f.code == "AMP603" and f.where.startswith("DynamicLossScaler (DeepSpeed) at ")
    assert "reached its minimum (1; the last scale tried: 1)" in f.detail
    assert '"min_loss_scale": 1' in f.fix and '{"bf16": {"enabled": True}}' in f.fix


def test_the_real_deepspeed_scaler_is_recognised():
    pytest.importorskip("deepspeed", reason="needs deepspeed (the test extra installs it)")
    from deepspeed.runtime.fp16 import loss_scaler

    from ampdoctor._compat.loss_scalers import loss_scaler_shape

    dynamic = loss_scaler.DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=False)
    for scaler in (dynamic, loss_scaler.LossScaler(scale=128)):
        shape = loss_scaler_shape(scaler)
        assert shape is not None and shape.method == "update_scale"
        assert shape.label(scaler) == f"{type(scaler).__name__} (DeepSpeed)"
    assert loss_scaler_shape(loss_scaler.LossScaler(scale=1.0)) is None   # ZeRO's in bf16 and fp32: scales nothing
    with ScaleMonitor(dynamic) as monitor:
        for _ in range(3):
            dynamic.update_scale(False)   # without an overflow DeepSpeed's scaler needs no process group
        monitor.consume({k: v.reshape(-1).tolist() for k, v in monitor.pending().items()})
    assert (monitor.steps, monitor.skipped, monitor.current_scale) == (3, 0, 65536.0)


# ---- apex, Megatron-LM ------------------------------------------------------------------------------------------
class LossScaler:
    """apex ``amp``'s ``LossScaler`` (``apex/amp/scaler.py``): ``loss_scale()``, and ``update_scale()`` that halves
    the scale on an overflow and returns whether to skip the step."""

    def __init__(self):
        self.dynamic, self._loss_scale, self._has_overflow = True, 2.0**16, False

    def loss_scale(self):
        return self._loss_scale

    def clear_overflow_state(self):
        self._has_overflow = False

    def update_scale(self):
        if self._has_overflow:
            self._loss_scale /= 2.0
        return self._has_overflow


class DynamicGradScaler:
    """Megatron-LM's ``DynamicGradScaler`` (``megatron/core/optimizer/grad_scaler.py``): its scale a one-element
    tensor on the device, ``inv_scale``, and ``update(found_inf)``."""

    def __init__(self):
        self._scale, self.min_scale = torch.tensor([2.0**16]), torch.tensor([1.0])

    @property
    def scale(self):
        return self._scale

    @property
    def inv_scale(self):
        return self._scale.double().reciprocal().float()

    def update(self, found_inf):
        if found_inf:
            self._scale = torch.max(self._scale * 0.5, self.min_scale)


def test_apex_and_megatron_scalers_feed_the_same_history():
    apex, megatron = LossScaler(), DynamicGradScaler()
    with ScaleMonitor(apex) as a, ScaleMonitor(megatron) as m:
        for overflow in (False, True, True, False):
            apex.clear_overflow_state()
            apex._has_overflow = overflow
            apex.update_scale()
            megatron.update(overflow)
        for monitor in (a, m):
            monitor.consume({k: v.reshape(-1).tolist() for k, v in monitor.pending().items()})
    for monitor, family in ((a, "LossScaler (apex)"), (m, "DynamicGradScaler (Megatron-LM)")):
        assert monitor.where == family
        assert (monitor.skipped_steps, monitor.current_scale) == ([1, 2], 2.0**14)
        assert monitor.history == [(0, 65536.0), (2, 32768.0), (3, 16384.0)]


# ---- the texts -------------------------------------------------------------------------------------------------
def test_explain_names_amp603_for_the_minimum_scale_texts_of_fairseq_and_deepspeed(capsys):
    for text in (FAIRSEQ_TEXT, FAIRSEQ_AMP_TEXT, DEEPSPEED_TEXT):
        assert main(["explain", text]) == 0, text
        out = " ".join(capsys.readouterr().out.split())
        assert out.startswith("AMP603 loss-scale-collapse") and "lowering the scale never helps" in out
        assert "--min-loss-scale" in out and '"min_loss_scale"' in out
