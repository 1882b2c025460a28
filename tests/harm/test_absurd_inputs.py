"""Do no harm, absurd inputs: setups nobody designs for get a clean report or a clear error from `check()`, `watch()`
and `ampdoctor run`, never a traceback from ampdoctor's internals (nor an AMP001, which is one caught), and the
training they watch runs exactly as it does alone.

The setups live in scripts/absurd.py: sparse gradients (nn.Embedding(sparse=True) + SGD + GradScaler), complex64
weights, 0-element parameters, tied weights, a parameter in two optimizers, deferred init on the meta device, a
model that never leaves the meta device, and a module whose output is its own Parameter. DTensor parameters are
built here, in a single-process gloo group.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import warnings

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.ui.cli import main

from .test_identity import (  # noqa: F401
    assert_same_training,
    codes,
    leftovers,
    load_script,
    one_torch_thread,
    run_script_plain,
    script_path,
    watch_all,
)

ABSURD = load_script("absurd.py")
CASES = ABSURD["CASES"]
REAL = [c for c in CASES if c != "meta"]  # cases with real numbers to compare bitwise



def _no_ampdoctor_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    src = os.path.dirname(ampdoctor.__file__)
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if w.filename.startswith(src)]


# ---- check() -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_check_gives_a_clean_report_on_absurd_setups(case):
    model, opts, scaler = ABSURD["build"](case)
    report = ampdoctor.check(model, opts, scaler, autocast_dtype=torch.float16 if scaler else None)
    assert "AMP001" not in report.codes(), report.findings
    data = json.loads(report.to_json())
    assert data["schema"] == "ampdoctor.core.report/1"


def test_check_reads_a_meta_model_without_touching_data():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)).half()
    opt = torch.optim.AdamW(model.parameters())
    report = ampdoctor.check(model, opt, torch.amp.GradScaler("cpu"), autocast_dtype=torch.float16)
    assert "AMP101" in report.codes()  # it did look: fp16 trainable params under an fp16 GradScaler
    assert "AMP001" not in report.codes()
    assert all(p.is_meta for p in model.parameters())


def test_check_on_a_model_without_parameters_is_a_clear_error():
    with pytest.raises(ValueError, match="no parameters"):
        ampdoctor.check(nn.Sequential(nn.ReLU()))


# ---- watch() -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", REAL)
def test_watch_trains_absurd_setups_bitwise_identically(case):
    model0, opts0, scaler0, losses0 = ABSURD["train"](case)
    attach, watches = watch_all()
    model1, opts1, scaler1, losses1 = ABSURD["train"](case, attach=attach)
    assert_same_training({"state": model0.state_dict(), "losses": losses0},
                         {"state": model1.state_dict(), "losses": losses1})
    (w,) = watches
    assert w.steps == 6
    assert "AMP001" not in codes(w.findings()), w.findings()
    assert leftovers(model1, *opts1, scaler1) == []


def test_watch_with_a_huge_every_allocates_nothing_huge():
    every = 2**40  # 8 TiB of buffer if preallocated: the allocation fails at once rather than filling memory
    attach, watches = watch_all(every=every)
    model0, _, _, losses0 = ABSURD["train"]("tied", steps=3)
    model1, _, _, losses1 = ABSURD["train"]("tied", steps=3, attach=attach)
    assert_same_training({"state": model0.state_dict(), "losses": losses0},
                         {"state": model1.state_dict(), "losses": losses1})
    assert watches[0].steps == 3
    assert "AMP001" not in codes(watches[0].findings()), watches[0].findings()
    assert watches[0].summary_data()["scale"]["steps"] == 3


def test_watch_adds_no_hook_to_a_parameter_that_a_module_returns():
    attach, _ = watch_all()
    model, _, _, _ = ABSURD["train"]("param-output", steps=5, attach=attach)
    hooks = model.log_scale.value._backward_hooks
    assert not hooks, f"{len(hooks)} hooks left on log_scale.value after 5 watched steps and detach()"


def test_watch_on_complex_weights_reports_true_norms_and_warns_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attach, watches = watch_all()
        model, _, _, _ = ABSURD["train"]("complex", steps=1, attach=attach)
    assert _no_ampdoctor_warnings(caught) == []
    stats = watches[0].last_grads.get("weight")
    if stats is not None:  # skipping complex gradients (like sparse ones) would do too
        assert stats["l2"] == pytest.approx(float(torch.linalg.vector_norm(model.weight.grad)), rel=1e-5)


def test_watch_refuses_a_meta_model_with_a_clear_error():
    model, opts, _ = ABSURD["build"]("meta")
    with pytest.raises((ValueError, TypeError), match="meta"):
        ampdoctor.watch(model, opts[0], every=1).detach()


def test_a_meta_model_under_watch_trains_as_alone():
    """Whatever watch() says about it, a meta model's loop must run as it does alone."""
    _, _, _, losses0 = ABSURD["train"]("meta")
    watches = []

    def attach(model, opt, scaler):
        try:
            watches.append(ampdoctor.watch(model, opt, scaler, every=1, activations=True))
        except (ValueError, TypeError):
            return contextlib.nullcontext()
        return watches[-1]

    model, opts, _, losses1 = ABSURD["train"]("meta", attach=attach)
    assert len(losses0) == len(losses1) == 6
    assert all(p.is_meta for p in model.parameters())
    assert leftovers(model, *opts) == []


def test_the_users_own_error_passes_through_unchanged():
    """torch cannot unscale complex gradients: the user's NotImplementedError is the same with and without watch,
    and its innermost frame is torch's, not ampdoctor's."""
    def attempt(attach):
        model = nn.Linear(4, 4).to(torch.complex64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        loss = model(torch.randn(2, 4, dtype=torch.complex64)).abs().sum()
        with attach(model, opt, scaler):
            scaler.scale(loss).backward()
            with pytest.raises(NotImplementedError) as info:
                scaler.step(opt)
        return info, model, opt, scaler

    plain, *_ = attempt(lambda *a: contextlib.nullcontext())
    attach, watches = watch_all()
    watched, model, opt, scaler = attempt(attach)
    assert str(watched.value) == str(plain.value)
    assert "ampdoctor" not in watched.traceback[-1].path.parts
    assert "AMP001" not in codes(watches[0].findings())
    assert leftovers(model, opt, scaler) == []


# ---- DTensor (a single-process gloo group) ---------------------------------------------------------------------

@pytest.fixture
def dtensor_mesh(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _dtensor_train(mesh, steps=5, attach=None):
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

    torch.manual_seed(0)
    model = distribute_module(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1)), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with (attach(model, opt, None) if attach else contextlib.nullcontext()):
        for _ in range(steps):
            x = distribute_tensor(torch.randn(16, 4), mesh, [Replicate()])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return model, opt, losses


def _local_state(model):
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def test_check_gives_a_clean_report_on_dtensor_parameters(dtensor_mesh):
    model, opt, _ = _dtensor_train(dtensor_mesh, steps=0)
    assert type(model[0].weight).__name__ == "DTensor"
    report = ampdoctor.check(model, opt, autocast_dtype=torch.bfloat16)
    assert "AMP001" not in report.codes(), report.findings


def test_watch_trains_dtensor_parameters_bitwise_identically(dtensor_mesh):
    model0, _, losses0 = _dtensor_train(dtensor_mesh)
    attach, watches = watch_all()
    model1, opt1, losses1 = _dtensor_train(dtensor_mesh, attach=attach)
    assert_same_training({"state": _local_state(model0), "losses": losses0},
                         {"state": _local_state(model1), "losses": losses1})
    assert watches[0].steps == 5
    assert leftovers(model1, opt1) == []


def test_watch_computes_gradient_statistics_of_dtensor_parameters(dtensor_mesh):
    attach, watches = watch_all()
    _dtensor_train(dtensor_mesh, attach=attach)
    assert [f"{f.where}: {f.detail}" for f in watches[0].findings() if f.code == "AMP001"] == []
    assert watches[0].last_grads["0.weight"]["l2"] > 0


# ---- ampdoctor run ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_ampdoctor_run_trains_absurd_setups_as_alone(case, tmp_path):
    base = run_script_plain("absurd.py", tmp_path / "base.pt", case)
    gc.collect()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(["run", "--every", "1", "--activations", "--json", str(tmp_path / "report.json"),
                     script_path("absurd.py"), str(tmp_path / "run.pt"), case])
    assert code == 0, err.getvalue()[-3000:]
    assert "Traceback" not in err.getvalue()
    result = torch.load(tmp_path / "run.pt")
    if case == "meta":
        assert len(result["losses"]) == len(base["losses"]) and all(t.is_meta for t in result["state"].values())
    else:
        assert_same_training(base, result)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [f["detail"] for f in report["findings"] if f["code"] == "AMP001"] == []
