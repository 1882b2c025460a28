"""Do no harm, isolation: a fault inside any part of ampdoctor is reported once (AMP001) and that part steps aside,
while the training goes on and ends bitwise identical to a run without ampdoctor.

Faults are injected into ampdoctor's own classes and functions only (torch is never touched): each injection point
below wraps the real method so that it raises, either from its first call or after a few good calls (a disk that
fills up mid-run). Each test also checks that the fault was really hit, so that none passes by not reaching it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import io
import json
import os
from typing import Any, Callable

import pytest
import torch

import ampdoctor.core.records.file
import ampdoctor.explanations.crash
import ampdoctor.guard.scaler_guard
import ampdoctor.monitor.activations
import ampdoctor.monitor.grad_stats
import ampdoctor.monitor.gradients
import ampdoctor.monitor.loss_scale
import ampdoctor.monitor.op_replay
import ampdoctor.monitor.updates
import ampdoctor.monitor.watcher
import ampdoctor.preflight.engine
import ampdoctor.preflight.rules
import ampdoctor.runner.doctor
from ampdoctor.ui.cli import main

from .test_identity import assert_same_training, codes, leftovers, load_script, one_torch_thread, script_path, watch_all  # noqa: F401


class InjectedFault(RuntimeError):
    pass


@dataclasses.dataclass
class Fault:
    """Where to inject: ``owner.name`` raises ``error`` on every call after the first ``after`` ones."""

    id: str
    owner: Callable[[], Any]  # resolved at test time: the modules may be reloaded by other tests
    name: str
    part: str  # a substring of the AMP001 finding's `where` (the part that steps aside)
    loop: str = "foreach"  # amp_loop.py kind
    after: int = 0
    error: Callable[[], BaseException] = lambda: InjectedFault("injected by tests/harm")
    dict_item: bool = False  # owner is a dict and name a key (a rule in CHECKS)
    steps_aside: bool = True  # once failed, the part never calls owner.name again


def _disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def inject(monkeypatch: pytest.MonkeyPatch, fault: Fault) -> list[int]:
    """Install ``fault``; return a one-element list counting the calls that reached it."""
    owner = fault.owner()
    original = owner[fault.name] if fault.dict_item else getattr(owner, fault.name)
    calls = [0]

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > fault.after:
            raise fault.error()
        return original(*args, **kwargs)

    if fault.dict_item:
        monkeypatch.setitem(owner, fault.name, broken)
    else:
        monkeypatch.setattr(owner, fault.name, broken)
    return calls


# ---- baselines, computed once -------------------------------------------------------------------------------

_BASELINES: dict[str, dict[str, Any]] = {}


def baseline(kind: str) -> dict[str, Any]:
    if kind not in _BASELINES:
        model, _, _, losses = load_script("amp_loop.py")["train"](kind)
        _BASELINES[kind] = {"state": model.state_dict(), "losses": losses}
    return _BASELINES[kind]


def amp001(findings: list[Any]) -> list[Any]:
    return [f for f in findings if f.code == "AMP001"]


# ---- faults inside watch() ------------------------------------------------------------------------------------

WATCH_FAULTS = [
    Fault("grad-stats", lambda: ampdoctor.monitor.grad_stats.GradStats, "compute", "gradients"),
    Fault("grad-stats-late", lambda: ampdoctor.monitor.grad_stats.GradStats, "compute", "gradients", after=4),
    Fault("grad-stats-unscaled", lambda: ampdoctor.monitor.grad_stats.GradStats, "compute", "gradients",
          loop="bf16-weights"),
    # the observer itself is what checks ScaleMonitor.disabled: replaced, it keeps being called (and ignored)
    Fault("scale-observer", lambda: ampdoctor.monitor.loss_scale.ScaleMonitor, "_before_update", "scale",
          steps_aside=False),
    Fault("scale-consume", lambda: ampdoctor.monitor.loss_scale.ScaleMonitor, "consume", "scale", after=2),
    Fault("lost-updates-consume", lambda: ampdoctor.monitor.updates.UpdateMonitor, "consume", "lost_updates",
          loop="bf16-weights", after=1),
    Fault("recorder-disk-full", lambda: ampdoctor.core.records.file.FlightRecorder, "write", "recorder", after=3,
          error=_disk_full),
    Fault("activation-hook", lambda: ampdoctor.monitor.activations.ActivationMonitor, "_forward_stats", "Activation"),
    Fault("activation-record", lambda: ampdoctor.monitor.activations.ActivationMonitor, "_close", "Activation",
          after=1),
    Fault("whole-sync", lambda: ampdoctor.monitor.watcher, "HostCopy", "watch", after=2),
    Fault("whole-sync-no-scaler", lambda: ampdoctor.monitor.watcher, "HostCopy", "watch", loop="bf16-weights",
          after=2),
]


@pytest.mark.parametrize("fault", WATCH_FAULTS, ids=lambda f: f.id if isinstance(f, Fault) else None)
def test_a_fault_inside_watch_is_reported_once_and_training_is_unchanged(fault, monkeypatch, tmp_path):
    base = baseline(fault.loop)
    calls = inject(monkeypatch, fault)
    attach, watches = watch_all(log_dir=str(tmp_path))
    model, opt, scaler, losses = load_script("amp_loop.py")["train"](fault.loop, attach=attach)
    monkeypatch.undo()

    assert calls[0] > fault.after, f"the fault in {fault.name} was never reached"
    if fault.steps_aside:
        assert calls[0] == fault.after + 1, f"{fault.name} was called {calls[0] - fault.after - 1} more time(s)"
    assert_same_training(base, {"state": model.state_dict(), "losses": losses})
    w = watches[0]
    errors = amp001(w.findings())
    assert len(errors) == 1, w.findings()
    assert fault.part in errors[0].where, errors[0]
    assert "InjectedFault" in errors[0].detail or "OSError" in errors[0].detail, errors[0]
    if fault.part != "watch":
        assert w.steps == 12  # the rest of the watch kept counting
    assert leftovers(model, opt, scaler) == []
    report = w.report()  # results stay readable after the fault
    assert json.loads(report.to_json())["watch"]["steps"] == 12


def test_the_other_parts_keep_working_when_one_steps_aside(monkeypatch):
    inject(monkeypatch, Fault("scale", lambda: ampdoctor.monitor.loss_scale.ScaleMonitor, "_before_update", "scale"))
    attach, watches = watch_all()
    load_script("amp_loop.py")["train"]("foreach", attach=attach)
    w = watches[0]
    assert len(w.norm_history) == 12  # gradients were still read at every step
    assert "AMP601" in codes(w.findings())  # and the activation monitor still found the overflow


def test_a_fault_in_the_forward_replay_restores_buffers_and_rng(monkeypatch):
    """The op-level re-run of a non-finite forward fails half-way (after BatchNorm ran in train mode): the
    running statistics and the RNG must be restored all the same."""
    calls = inject(monkeypatch, Fault("op-trace", lambda: ampdoctor.monitor.op_replay.NonfiniteOpTracer,
                                      "__torch_dispatch__", "", after=6))
    base = baseline("foreach")
    attach, watches = watch_all()
    model, _, _, losses = load_script("amp_loop.py")["train"]("foreach", attach=attach)
    assert calls[0] > 6
    assert_same_training(base, {"state": model.state_dict(), "losses": losses})
    amp601 = [f for f in watches[0].findings() if f.code == "AMP601"]
    assert amp601 and "InjectedFault" in amp601[0].detail  # reported inside the finding, not as a crash


# ---- faults inside `ampdoctor run` (the Doctor, the ScalerGuard, the rules) ---------------------------------------

def _boom_rule(setup: Any) -> Any:
    raise InjectedFault("injected by tests/harm")
    yield  # pragma: no cover  (a generator, like the real checks)


RUN_FAULTS = [
    Fault("rule", lambda: ampdoctor.preflight.rules.CHECKS, "AMP101", "rule AMP101", dict_item=True),
    Fault("preflight", lambda: ampdoctor.preflight.engine, "run_preflight", "ampdoctor"),
    Fault("guard-step", lambda: ampdoctor.guard.scaler_guard.ScalerGuard, "_before_step", "ScalerGuard"),
    Fault("guard-update", lambda: ampdoctor.guard.scaler_guard.ScalerGuard, "_after_update", "ScalerGuard", after=3),
    Fault("guard-clip", lambda: ampdoctor.guard.scaler_guard.ScalerGuard, "_after_clip", "ScalerGuard"),
    Fault("guard-scheduler", lambda: ampdoctor.guard.scaler_guard.ScalerGuard, "_before_scheduler", "ScalerGuard",
          after=1),
    Fault("attach-watch", lambda: ampdoctor.monitor.watcher.Watch, "attach", "ampdoctor"),
    Fault("recorder-disk-full-at-open", lambda: ampdoctor.core.records.file.FlightRecorder, "write", "ampdoctor",
          error=_disk_full),
    Fault("recorder-disk-full-later", lambda: ampdoctor.core.records.file.FlightRecorder, "write", "recorder", after=4,
          error=_disk_full),
    # summary_data() runs twice: for the doctor's report, then for the recorder's end line at detach
    Fault("watch-report", lambda: ampdoctor.monitor.gradients, "rollup", "ampdoctor", steps_aside=False),
    Fault("activation-hook", lambda: ampdoctor.monitor.activations.ActivationMonitor, "_forward_stats", "Activation"),
]


def _run_doctor(tmp_path, script: str, *args: str) -> tuple[int, dict[str, Any], str]:
    gc.collect()  # see test_identity.py::test_doctor_ignores_garbage_from_earlier_runs
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["run", "--every", "1", "--activations", "--log-dir", str(tmp_path / "log"),
                     "--json", str(tmp_path / "report.json"), script_path(script), *args])
    return code, json.loads((tmp_path / "report.json").read_text()), err.getvalue()


@pytest.mark.parametrize("fault", RUN_FAULTS, ids=lambda f: f.id)
def test_a_fault_inside_ampdoctor_run_is_reported_once_and_training_is_unchanged(fault, monkeypatch, tmp_path):
    base = baseline("foreach")
    calls = inject(monkeypatch, fault)
    code, report, err = _run_doctor(tmp_path, "amp_loop.py", str(tmp_path / "run.pt"), "foreach")
    monkeypatch.undo()

    assert code == 0, err[-3000:]
    assert calls[0] > fault.after, f"the fault in {fault.name} was never reached"
    if fault.steps_aside:
        assert calls[0] == fault.after + 1, f"{fault.name} was called {calls[0] - fault.after - 1} more time(s)"
    assert_same_training(base, torch.load(tmp_path / "run.pt"))
    errors = [f for f in report["findings"] if f["code"] == "AMP001"]
    assert len(errors) == 1, report["findings"]
    assert fault.part in errors[0]["where"], errors[0]
    assert "InjectedFault" in errors[0]["detail"] or "OSError" in errors[0]["detail"]
    assert "Traceback" not in err


def test_check_reports_a_broken_rule_once_and_runs_the_others(monkeypatch):
    monkeypatch.setitem(ampdoctor.preflight.rules.CHECKS, "AMP101", _boom_rule)
    model = torch.nn.Linear(4, 4).half()
    report = ampdoctor.preflight.engine.check(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       torch.amp.GradScaler("cpu"), autocast_dtype=torch.bfloat16)
    assert [f.where for f in report.findings if f.code == "AMP001"] == ["rule AMP101"]
    assert "AMP201" in report.codes()  # the other rules still ran: a GradScaler under bf16 autocast


def test_a_fault_while_explaining_a_crash_keeps_the_scripts_own_error(monkeypatch, tmp_path):
    """The script fails; explaining it fails too. The user still gets the script's traceback and exit status 1."""
    fault = Fault("explain", lambda: ampdoctor.explanations.crash, "explain_exception", "ampdoctor")
    calls = inject(monkeypatch, fault)
    script = tmp_path / "fails.py"
    script.write_text("import torch\nraise KeyError('the script itself')\n")
    gc.collect()
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["run", "--json", str(tmp_path / "report.json"), str(script)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert calls[0] >= 1
    assert code == 1
    assert "KeyError: 'the script itself'" in err.getvalue()
    assert report["exception"]["type"] == "KeyError"
    assert [f["where"] for f in report["findings"] if f["code"] == "AMP001"] == ["ampdoctor"]
