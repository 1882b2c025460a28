"""ampdoctor with huggingface accelerate: ``check(accelerator=...)``, ``watch()`` and ``ampdoctor run``.

Real ``Accelerator`` objects throughout. accelerate 1.x sets up fp16 only off the CPU (``Accelerator.__init__``:
``mixed_precision == "fp16" and self.device.type != "cpu"``; on a CPU it leaves ``native_amp=False`` and
``scaler=None``, which is AMP203). So the fp16 tests build ``Accelerator(mixed_precision="fp16", cpu=True)`` and
set, before ``prepare``, the two attributes the GPU branch would have set; read in the installed accelerate (1.15):

* ``native_amp = True``: ``prepare_model`` wraps ``model.forward`` in ``get_mixed_precision_context_manager``,
  which for ``state.mixed_precision == "fp16"`` is ``torch.autocast(state.device.type, dtype=torch.float16)``,
  i.e. ``torch.autocast("cpu", dtype=torch.float16)``; and ``unscale_gradients`` (hence ``clip_grad_norm_``) only
  unscales when ``native_amp and mixed_precision == "fp16"``. With ``mixed_precision="no"`` and a hand-made
  autocast, ``accelerator.clip_grad_norm_`` would clip the *scaled* gradients and the seed error could not surface
  through it.
* ``scaler = torch.amp.GradScaler("cpu")``: ``backward`` calls ``self.scaler.scale(loss).backward()``, and
  ``prepare_optimizer`` hands ``self.scaler`` to each ``AcceleratedOptimizer``, whose ``step()`` runs
  ``scaler.step(optimizer)`` + ``scaler.update()`` when ``sync_gradients`` and sets ``step_was_skipped`` when the
  inner ``step`` was not called.

`test_the_cpu_fp16_setup_is_accelerates_fp16_path` checks each of these on the real objects. The scripts are
``examples/accelerate_train.py`` (it does the same set-up), run in this process through the launcher, except for
the ``accelerate launch`` test.
"""

import json
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.core.options import RunOptions  # noqa: E402
from ampdoctor.runner.doctor import Doctor  # noqa: E402
from ampdoctor.runner.launcher import run_script  # noqa: E402
from ampdoctor.ui.cli import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "accelerate_train.py")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # AcceleratorState and GradientState are process-wide singletons: each test builds its own Accelerator.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def fp16_accelerator(**kwargs):
    """Accelerator(mixed_precision="fp16") as accelerate sets it up on a GPU, on the CPU (see the module doc)."""
    init_scale = kwargs.pop("init_scale", 2.0 ** 16)
    acc = Accelerator(mixed_precision="fp16", cpu=True, **kwargs)
    assert acc.scaler is None and not acc.native_amp   # what accelerate does on a CPU (AMP203)
    acc.native_amp = True
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return acc


def classifier(half_head=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    if half_head:
        model[2].half()
    return model


def run(args, fix=False, watch=True, every=1):
    result = run_script(SCRIPT, args, Doctor(RunOptions(fix=fix, watch=watch, every=every)))
    return result, result.report.to_dict()


def printed_skips(out):
    return json.loads(re.search(r"skipped updates: (\[.*\])", out).group(1))


# ---- the set-up the other tests rely on -------------------------------------------------------------------------
def test_the_cpu_fp16_setup_is_accelerates_fp16_path():
    acc = fp16_accelerator()
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = classifier()
    model, opt = acc.prepare(model, opt)
    seen = []
    model[2].register_forward_hook(lambda m, i, o: seen.append((torch.is_autocast_enabled("cpu"), o.dtype)))
    x = torch.randn(4, 8)
    out = model(x)
    assert hasattr(model, "_original_forward")                 # prepare wrapped forward...
    assert seen == [(True, torch.float16)]                     # ...in torch.autocast("cpu", dtype=torch.float16)
    assert out.dtype == torch.float32                          # convert_outputs_to_fp32
    assert type(opt).__name__ == "AcceleratedOptimizer" and opt.scaler is acc.scaler
    acc.backward(out.mean())                                   # scaler.scale(loss).backward()
    with torch.autocast("cpu", dtype=torch.float16):
        reference(x).float().mean().backward()
    assert torch.equal(model[2].bias.grad, reference[2].bias.grad * 2.0 ** 16)
    acc.clip_grad_norm_(model.parameters(), 1e9)               # unscales first: the scale is gone
    assert torch.equal(model[2].bias.grad, reference[2].bias.grad)


# ---- check(..., accelerator=acc) ---------------------------------------------------------------------------------
def test_check_takes_the_scaler_and_autocast_from_the_accelerator():
    acc = fp16_accelerator()
    model = classifier(half_head=True)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    report = ampdoctor.check(model, opt, accelerator=acc)
    assert report.codes() == ["AMP101"]
    assert "2.weight (float16, [3, 16]), 2.bias (float16, [3])" in report.findings[0].detail


def test_check_is_quiet_on_a_clean_bf16_accelerator():
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    model = classifier()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    assert ampdoctor.check(model, opt, accelerator=acc).codes() == []


def test_check_on_a_cpu_fp16_accelerator_says_fp16_is_not_in_effect():
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    model = classifier()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    assert ampdoctor.check(model, opt, accelerator=acc).codes() == ["AMP203"]


# ---- watch() -----------------------------------------------------------------------------------------------------
def accumulate_and_watch(scaler_given, init_scale, micro=4, updates=6):
    acc = fp16_accelerator(gradient_accumulation_steps=micro, init_scale=init_scale)
    model = classifier()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    skipped, synced = [], 0
    with ampdoctor.watch(model, opt, acc.scaler if scaler_given else None, every=1) as w:
        for _ in range(micro * updates):
            with acc.accumulate(model):
                acc.backward(model(torch.randn(4, 8)).float().pow(2).mean())
                opt.step()
                opt.zero_grad()
                if acc.sync_gradients:
                    if acc.optimizer_step_was_skipped:
                        skipped.append(synced)
                    synced += 1
    return w, skipped, synced


@pytest.mark.parametrize("scaler_given", [True, False], ids=["scaler-given", "scaler-from-optimizer"])
def test_watch_counts_optimizer_steps_and_agrees_on_skips(scaler_given):
    # 2**24: the first updates overflow in fp16 and are skipped, the scale halves until they fit
    w, skipped, synced = accumulate_and_watch(scaler_given, init_scale=2.0 ** 24)
    data = w.summary_data()
    assert synced == 6 and w.steps == 6                    # optimizer steps, not the 24 micro-batches
    assert skipped and len(skipped) < synced               # some skipped, not all: the test means something
    assert data["scale"]["skipped_steps"] == skipped       # accelerator.optimizer_step_was_skipped, step by step


def test_watch_finds_nothing_wrong_with_clean_accumulation():
    w, skipped, _ = accumulate_and_watch(True, init_scale=2.0 ** 10)
    assert skipped == [] and w.summary_data()["scale"]["skipped_steps"] == []
    assert w.findings() == []


# ---- ampdoctor run -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [[], ["--no-clip"]], ids=["accelerator.clip_grad_norm_", "optimizer.step"])
def test_run_names_the_stray_head_once_and_explains_the_crash(args, capsys):
    result, report = run(args, watch=False)
    err = capsys.readouterr().err
    assert result.exit_code == 1 and result.explained
    assert report["exception"]["message"] == "Attempting to unscale FP16 gradients."
    where = "accelerator.clip_grad_norm_" if not args else "optimizer.step()"
    assert where in report["exception"]["traceback"]
    amp101 = [f for f in report["findings"] if f["code"] == "AMP101"]
    assert len(amp101) == 1 and amp101[0]["severity"] == "error" and amp101[0]["where"] == "head"
    assert "head.weight (float16, [4, 64]), head.bias (float16, [4])" in amp101[0]["detail"]
    assert "backbone" not in amp101[0]["detail"]
    # AMP104 is true too (AdamW eps=1e-8 on the fp16 head); nothing else, and no AMP410 for prepare()'s reload
    assert sorted(f["code"] for f in report["findings"]) == ["AMP101", "AMP104"]
    assert "not a known mixed-precision failure" not in err


def test_run_fix_trains_to_the_end(capsys):
    result, report = run([], fix=True)
    out = capsys.readouterr().out
    assert result.exit_code == 0 and report["exception"] is None
    assert "done: 8 optimizer steps over 8 micro-batches; skipped updates: []" in out
    assert report["changes"] == ["head.weight: upcast torch.float16 -> torch.float32",
                                 "head.bias: upcast torch.float16 -> torch.float32"]
    assert [(f["code"], f["severity"]) for f in report["findings"]] == [("AMP101", "info"), ("AMP104", "info")]
    assert report["watch"]["steps"] == 8


def test_run_on_gradient_accumulation_counts_optimizer_steps(capsys):
    result, report = run(["--no-stray", "--accumulate", "4"])
    out = capsys.readouterr().out
    assert result.exit_code == 0
    assert "done: 8 optimizer steps over 32 micro-batches; skipped updates: []" in out
    assert report["findings"] == [] and report["ok"]
    assert report["watch"]["steps"] == 8 and report["watch"]["scale"]["skipped_steps"] == []


def test_run_skipped_steps_agree_with_accelerate(capsys):
    result, report = run(["--no-stray", "--accumulate", "4", "--init-scale", str(2.0 ** 24)])
    skipped = printed_skips(capsys.readouterr().out)
    assert result.exit_code == 0 and 0 < len(skipped) < 8
    assert report["watch"]["steps"] == 8 and report["watch"]["scale"]["skipped_steps"] == skipped


def test_run_on_a_clean_bf16_accelerator_finds_nothing(capsys):
    result, report = run(["--no-stray", "--bf16"])
    assert result.exit_code == 0
    assert [f for f in report["findings"] if f["severity"] != "info"] == [] and report["ok"]
    assert report["observed"] == {"models": 1, "optimizers": 1, "scalers": 0}


def test_training_is_bitwise_identical_under_run(capsys, monkeypatch):
    args = ["--no-stray", "--accumulate", "2", "--init-scale", str(2.0 ** 20)]
    monkeypatch.setattr(sys, "argv", [SCRIPT, *args])
    runpy.run_path(SCRIPT, run_name="__main__")
    plain = capsys.readouterr().out
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run(args)
    watched = capsys.readouterr().out
    assert plain.count("loss") == 8 and watched == plain


def test_a_real_resume_without_the_scaler_is_still_reported():
    # prepare() reloads the optimizer's own state onto the device (AcceleratedOptimizer.__init__): not a resume.
    # A checkpoint loaded by the script, without the GradScaler's state, is one.
    saved_model = classifier()
    saved_opt = torch.optim.AdamW(saved_model.parameters())
    saved_model(torch.randn(2, 8)).sum().backward()
    saved_opt.step()
    with Doctor(RunOptions(watch=False)) as doctor:
        acc = fp16_accelerator()
        model = classifier()
        opt = torch.optim.AdamW(model.parameters())
        opt.load_state_dict(saved_opt.state_dict())
        model, opt = acc.prepare(model, opt)
        acc.backward(model(torch.randn(2, 8)).sum())
        opt.step()
    assert "AMP410" in doctor.report.codes()


def test_prepare_alone_is_not_a_resume():
    with Doctor(RunOptions(watch=False)) as doctor:
        acc = fp16_accelerator()
        model = classifier()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
        for _ in range(2):
            acc.backward(model(torch.randn(2, 8)).sum())
            opt.step()
            opt.zero_grad()
    assert doctor.report.codes() == []


# ---- accelerate launch -------------------------------------------------------------------------------------------
def test_accelerate_launch_runs_ampdoctor_run(tmp_path):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK",
                                                                    "WORLD_SIZE", "MASTER_"))}
    env["HF_HOME"] = str(tmp_path / "hf")    # no accelerate config file: launch uses its defaults
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    proc = subprocess.run([launcher, "launch", "--cpu", "--num_processes", "1", "-m", "ampdoctor", "run",
                           "--json", str(out), SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]      # the script's own failure, passed on by launch
    assert "ValueError: Attempting to unscale FP16 gradients." in proc.stderr
    report = json.loads(out.read_text())
    assert sorted(f["code"] for f in report["findings"]) == ["AMP101", "AMP104"]
    assert "head.weight (float16, [4, 64]), head.bias (float16, [4])" in report["findings"][0]["detail"]


@pytest.mark.parametrize("kind", ["filter", "list"])
def test_accelerator_clip_grad_norm_is_observed_where_it_calls_no_torch_clip(tmp_path, kind):
    # accelerate 1.x computes the norm with get_total_norm and clips with clip_grads_with_norm_; over a consumed
    # filter it calls neither and returns 0. Only the observed wrapper sees that (AMP618), and its norm feeds AMP611.
    script = os.path.join(ROOT, "tests", "integrations", "scripts", "accelerate_clip_filter.py")
    out = tmp_path / "r.json"
    assert main(["run", "--json", str(out), script, kind, "0.01"]) == 0
    report = json.loads(out.read_text())
    codes = [f["code"] for f in report["findings"]]
    if kind == "filter":
        assert "AMP618" in codes and "AMP611" not in codes, codes
        assert report["clipping"]["calls"] == 12 and report["clipping"]["peak"] == 0.0, report.get("clipping")
    else:
        assert "AMP618" not in codes and "AMP611" in codes, codes   # it now clips every step at 0.01
