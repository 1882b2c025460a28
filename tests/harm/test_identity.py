"""Do no harm, identity: ampdoctor watching a run changes nothing in it, and leaves nothing behind.

Every loop here is run twice in this process, once alone and once watched (``ampdoctor.watch`` with every=1, full
statistics and the activation monitor, or ``ampdoctor run --every 1 --activations``). The final parameters and
buffers must be bitwise equal, and so must the losses (compared as IEEE-754 bit patterns, so that the NaN loss of
the step the GradScaler skips compares equal to itself). After detach no hook, observer or patched method of
ampdoctor's may remain on the training objects or in torch's global hook tables, and the objects must be free to
die.

The helpers at the top are shared with the other files of this folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import json
import runpy
import shutil
import struct
import sys
import threading
import types
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.modules.module as module_globals
import torch.nn.utils.clip_grad
import torch.optim.optimizer as optimizer_globals
from torch import nn
from torch.optim import lr_scheduler

import ampdoctor
from ampdoctor.core.options import RunOptions
from ampdoctor.runner.doctor import Doctor
from ampdoctor.runner.launcher import run_script
from ampdoctor.ui.cli import main

SCRIPTS = Path(__file__).parent / "scripts"


# ---- helpers shared by tests/harm --------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def one_torch_thread():
    """Run the tiny models of these tests on one intra-op thread. With two OpenMP threads on a busy 2-core machine
    every op waits at a barrier (measured: a 12-step loop takes 1.6 s instead of 0.025 s); both sides of every
    comparison run under the same setting, so identity is unaffected. Imported by the other files of this folder."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def script_path(name: str) -> str:
    return str(SCRIPTS / name)


def load_script(name: str) -> dict[str, Any]:
    """Return the globals of a script in tests/harm/scripts, without running its ``__main__`` block."""
    return runpy.run_path(script_path(name), run_name="harm_script")


def loss_bits(losses: list[float]) -> list[bytes]:
    """IEEE-754 bit patterns: bitwise equality, NaN included (``nan != nan`` under ``==``)."""
    return [struct.pack("<d", float(v)) for v in losses]


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(tensor_bits(a[name]), tensor_bits(b[name])), f"{name} differs"


def assert_same_training(base: dict[str, Any], watched: dict[str, Any]) -> None:
    """``base`` and ``watched`` are ``{"state": state_dict, "losses": [...]}``."""
    assert loss_bits(watched["losses"]) == loss_bits(base["losses"]), (base["losses"], watched["losses"])
    assert_bitwise_equal_state(base["state"], watched["state"])


def run_script_plain(name: str, out: Path, *args: str) -> dict[str, Any]:
    """Run a script as ``python script.py OUT ARGS`` would, in this process, without ampdoctor."""
    path = script_path(name)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, str(out), *args]
    sys.path.insert(0, str(SCRIPTS))
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    gc.collect()  # the script's objects are cyclic garbage now; see test_doctor_ignores_garbage_from_earlier_runs
    return torch.load(out)


class Sink:
    """Installed as the ``harm_sink`` module: the scripts hand it their model, optimizer, scaler..."""

    def __init__(self, weak: bool = False) -> None:
        self.weak = weak
        self.objects: list[Any] = []

    def keep(self, *objects: Any) -> None:
        self.objects += [weakref.ref(o) if self.weak else o for o in objects if o is not None]

    @contextlib.contextmanager
    def installed(self):
        module = types.ModuleType("harm_sink")
        module.keep = self.keep  # type: ignore[attr-defined]
        sys.modules["harm_sink"] = module
        try:
            yield self
        finally:
            del sys.modules["harm_sink"]


def _is_ours(value: Any) -> bool:
    """Whether ``value`` is a function, method, partial or object of ampdoctor's."""
    for _ in range(4):
        if isinstance(value, functools.partial):
            value = value.func
            continue
        owner = getattr(value, "__self__", None)
        if owner is not None and not isinstance(owner, types.ModuleType):
            if type(owner).__module__.startswith("ampdoctor"):
                return True
        if getattr(value, "__ampdoctor_observer__", False):
            return True
        module = getattr(value, "__module__", None) or type(value).__module__
        if isinstance(module, str) and module.startswith("ampdoctor"):
            return True
        wrapped = getattr(value, "__wrapped__", None)
        if wrapped is None:
            return False
        value = wrapped
    return False


def _hook_table(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(value.items())
    return value


def global_state() -> dict[str, Any]:
    """What ampdoctor could touch outside the training objects: torch's global hook tables and the methods and
    functions it observes, compared by identity."""
    state: dict[str, Any] = {}
    for name in dir(module_globals):
        if name.startswith("_global_"):
            state[f"torch.nn.modules.module.{name}"] = _hook_table(getattr(module_globals, name))
    for name in dir(optimizer_globals):
        if name.startswith("_global_"):
            state[f"torch.optim.optimizer.{name}"] = _hook_table(getattr(optimizer_globals, name))
    classes: list[type] = [torch.amp.GradScaler, torch.optim.Optimizer, torch.optim.AdamW, torch.optim.SGD,
                           nn.Module, torch.Tensor]
    classes += [c for c in vars(lr_scheduler).values()
                if isinstance(c, type) and issubclass(c, lr_scheduler.LRScheduler)]
    for cls in classes:
        state[f"vars({cls.__qualname__})"] = tuple((k, id(v)) for k, v in vars(cls).items())
    for owner, name in [(torch.nn.utils, "clip_grad_norm_"), (torch.nn.utils.clip_grad, "clip_grad_norm_"),
                        (torch.nn.utils, "clip_grad_value_"), (torch, "autocast")]:
        state[f"{owner.__name__}.{name}"] = getattr(owner, name)
    state["LRScheduler.step"] = lr_scheduler.LRScheduler.step
    state["torch function modes"] = torch._C._len_torch_function_stack()
    state["torch dispatch modes"] = torch._C._len_torch_dispatch_stack()
    state["grad enabled"] = torch.is_grad_enabled()
    state["autocast cpu"] = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    state["default dtype"] = torch.get_default_dtype()
    state["trace/profile"] = (sys.gettrace(), sys.getprofile())
    state["excepthooks"] = (sys.excepthook, threading.excepthook)
    state["warnings.filters"] = tuple(warnings.filters)
    return state


def assert_same_globals(before: dict[str, Any], after: dict[str, Any]) -> None:
    changed = [k for k in before if before[k] != after.get(k)] + [k for k in after if k not in before]
    assert not changed, {k: (before.get(k), after.get(k)) for k in changed}


def objects_of(*roots: Any) -> list[Any]:
    """The modules (all submodules), parameters, optimizers (and what they wrap) and scalers among ``roots``."""
    out: list[Any] = []
    for root in roots:
        if isinstance(root, nn.Module):
            out += list(root.modules()) + list(root.parameters())
        elif isinstance(root, torch.optim.Optimizer):
            out.append(root)
            inner = getattr(root, "optimizer", None)
            if isinstance(inner, torch.optim.Optimizer):
                out.append(inner)
        elif root is not None:
            out.append(root)
            scaler = getattr(root, "scaler", None)  # an Accelerator
            if scaler is not None:
                out.append(scaler)
    return out


def fingerprint(obj: Any) -> dict[str, Any]:
    """Hook tables (their callbacks' names), instance attributes (their types) and tensor hooks of ``obj``."""
    if isinstance(obj, torch.Tensor):
        return {"backward_hooks": _names(obj._backward_hooks),
                "post_accumulate_grad_hooks": _names(obj._post_accumulate_grad_hooks)}
    data = {}
    for key, value in vars(obj).items():
        if "hook" in key and isinstance(value, dict):
            data[key] = _names(value)
        else:
            data[key] = type(value).__qualname__
    return data


def _names(table: dict | None) -> tuple[str, ...] | None:
    if table is None:
        return None
    return tuple(getattr(f, "__qualname__", type(f).__qualname__) for f in table.values())


def leftovers(*roots: Any) -> list[str]:
    """Every hook, observer or instance attribute of ampdoctor's still attached to the training objects, to torch's
    global hook tables or to the classes and functions it observes."""
    found = []
    for obj in objects_of(*roots):
        if isinstance(obj, torch.Tensor):
            tables = {"_backward_hooks": obj._backward_hooks, "_post_accumulate_grad_hooks":
                      obj._post_accumulate_grad_hooks}
        else:
            tables = {k: v for k, v in vars(obj).items()}
        for key, value in tables.items():
            values = value.values() if isinstance(value, dict) and "hook" in key else [value]
            found += [f"{type(obj).__name__}.{key}: {v!r:.100}" for v in values if _is_ours(v)]
    for name, table in [(n, getattr(module_globals, n)) for n in dir(module_globals) if n.startswith("_global_")] + \
                       [(n, getattr(optimizer_globals, n)) for n in dir(optimizer_globals) if n.startswith("_global_")]:
        if isinstance(table, dict):
            found += [f"{name}: {v!r:.100}" for v in table.values() if _is_ours(v)]
    for cls in [torch.amp.GradScaler] + [c for c in vars(lr_scheduler).values() if isinstance(c, type)]:
        found += [f"{cls.__name__}.{k}" for k, v in vars(cls).items() if _is_ours(v)]
    for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
        if _is_ours(owner.clip_grad_norm_):
            found.append(f"{owner.__name__}.clip_grad_norm_")
    return found


def assert_same_fingerprints(base: list[Any], watched: list[Any]) -> None:
    """The watched run's objects look exactly like the plain run's ones: same hooks, same attributes."""
    assert [type(o).__qualname__ for o in base] == [type(o).__qualname__ for o in watched]
    for a, b in zip(base, watched):
        assert fingerprint(a) == fingerprint(b), type(a).__name__


def watch_all(**kwargs: Any) -> tuple[Callable[..., Any], list[Any]]:
    """An ``attach(model, opt, scaler)`` for the scripts' ``train``: the strictest watch; the Watch objects are kept."""
    watches: list[Any] = []

    def attach(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> Any:
        options = dict(every=1, stats="full", activations=True)
        options.update(kwargs)
        w = ampdoctor.watch(model, opt, scaler, **options)
        watches.append(w)
        return w

    return attach, watches


def codes(findings: list[Any]) -> list[str]:
    return [f.code for f in findings]


# ---- watch(): plain fp16 autocast + GradScaler, foreach and fused AdamW, pure bf16 weights ----------------------

@pytest.mark.parametrize("kind, stats", [("foreach", "full"), ("fused", "full"), ("foreach", "exact"),
                                         ("bf16-weights", "full")])
def test_watch_leaves_the_amp_loop_bitwise_identical(kind, stats, tmp_path):
    train = load_script("amp_loop.py")["train"]
    model0, opt0, scaler0, losses0 = train(kind)
    rng0 = torch.get_rng_state()
    before = global_state()
    attach, watches = watch_all(stats=stats, log_dir=str(tmp_path))
    model1, opt1, scaler1, losses1 = train(kind, attach=attach)
    (w,) = watches

    assert_same_training({"state": model0.state_dict(), "losses": losses0},
                         {"state": model1.state_dict(), "losses": losses1})
    assert torch.equal(torch.get_rng_state(), rng0)  # the global RNG advanced exactly as without the watch
    for a, b in zip(opt0.state_dict()["state"].values(), opt1.state_dict()["state"].values()):
        assert_bitwise_equal_state(a, b)
    if scaler0 is not None:
        assert scaler0.state_dict() == scaler1.state_dict()
    # the watch did look, at every step: the test is not vacuous
    assert (w.steps, w.sampled_steps) == (12, 12)
    expected = "AMP607" if kind == "bf16-weights" else "AMP601"  # AMP601's re-run of the forward ran too
    assert expected in codes(w.findings()), w.findings()
    assert "AMP001" not in codes(w.findings()), w.findings()
    # nothing left behind
    assert_same_globals(before, global_state())
    assert leftovers(model1, opt1, scaler1) == []
    assert_same_fingerprints(objects_of(model0, opt0, scaler0), objects_of(model1, opt1, scaler1))


# ---- watch(): accelerate ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_watch_leaves_an_accelerate_loop_bitwise_identical(precision):
    train = load_script("accelerate_loop.py")["train"]
    model0, opt0, acc0, losses0 = train(precision)
    before = global_state()
    watches: list[Any] = []

    def attach(model, opt, scaler):  # opt is accelerate's AcceleratedOptimizer, as prepare() returns it
        watches.append(ampdoctor.watch(model, opt, scaler, every=1, activations=True))
        return watches[-1]

    model1, opt1, acc1, losses1 = train(precision, attach=attach)
    assert_same_training({"state": model0.state_dict(), "losses": losses0},
                         {"state": model1.state_dict(), "losses": losses1})
    (w,) = watches
    assert (w.steps, w.sampled_steps) == (10, 10)
    assert w.summary_data()["gradients"]["global_norm"] > 0
    assert "AMP001" not in codes(w.findings())
    assert_same_globals(before, global_state())
    assert leftovers(model1, opt1, acc1) == []
    assert_same_fingerprints(objects_of(model0, opt0, acc0), objects_of(model1, opt1, acc1))


def test_watch_accepts_the_optimizer_accelerate_returns():
    """What a user writes after ``model, opt = accelerator.prepare(model, opt)``: a clear error or a working watch,
    never torch's AttributeError from inside attach()."""
    train = load_script("accelerate_loop.py")["train"]
    watches: list[Any] = []
    errors: list[BaseException] = []

    def attach(model, opt, scaler):
        try:
            watches.append(ampdoctor.watch(model, opt, scaler, every=1))
        except (TypeError, ValueError) as exc:  # a clear refusal would do
            errors.append(exc)
            return contextlib.nullcontext()
        return watches[-1]

    train("bf16", steps=3, attach=attach)
    if errors:
        assert "AcceleratedOptimizer" in str(errors[0]) and ".optimizer" in str(errors[0])
    else:
        assert watches[0].steps == 3


# ---- watch(): Lightning ----------------------------------------------------------------------------------------

def test_watch_leaves_a_lightning_loop_bitwise_identical():
    import lightning as L

    script = load_script("lightning_loop.py")
    module0, trainer0, losses0 = script["train"]()
    before = global_state()

    class WatchCallback(L.Callback):
        def __init__(self) -> None:
            self.watch: Any = None

        def on_train_start(self, trainer, pl_module):
            self.watch = ampdoctor.watch(pl_module, trainer.optimizers[0], every=1, activations=True)

        def on_train_end(self, trainer, pl_module):
            self.watch.detach()

    callback = WatchCallback()
    module1, trainer1, losses1 = script["train"](callbacks=[callback])
    assert_same_training({"state": module0.state_dict(), "losses": losses0},
                         {"state": module1.state_dict(), "losses": losses1})
    w = callback.watch
    assert (w.steps, w.sampled_steps) == (10, 10)
    assert "AMP001" not in codes(w.findings())
    assert_same_globals(before, global_state())
    assert leftovers(module1, *trainer1.optimizers) == []
    assert_same_fingerprints(objects_of(module0.net, *trainer0.optimizers),
                             objects_of(module1.net, *trainer1.optimizers))


# ---- `ampdoctor run --every 1 --activations` -------------------------------------------------------------------

RUN_CASES = [
    ("amp_loop.py", "foreach", 12),
    ("amp_loop.py", "fused", 12),
    ("amp_loop.py", "bf16-weights", 12),
    ("accelerate_loop.py", "bf16", 10),
    ("accelerate_loop.py", "no", 10),
    ("lightning_loop.py", "bf16-mixed", 10),
]
_RUN_IDS = [f"{script.removesuffix('.py')}-{arg}" for script, arg, _ in RUN_CASES]


@dataclasses.dataclass
class RunOutcome:
    code: int
    base: dict[str, Any]
    result: dict[str, Any]
    report: dict[str, Any]
    globals_before: dict[str, Any]
    globals_after: dict[str, Any]
    base_fingerprints: list[tuple[str, dict[str, Any]]]
    run_fingerprints: list[tuple[str, dict[str, Any]]]
    leftovers: list[str]


@pytest.fixture(scope="module")
def run_outcome(tmp_path_factory):
    """Run each case once, plainly and under `ampdoctor run`; the tests below look at different parts of it."""
    cache: dict[tuple[str, str], RunOutcome] = {}

    def get(script: str, arg: str) -> RunOutcome:
        if (script, arg) not in cache:
            tmp = tmp_path_factory.mktemp(f"run-{script}-{arg}")
            base_sink, run_sink = Sink(), Sink()
            with base_sink.installed():
                base = run_script_plain(script, tmp / "base.pt", arg)
            base_fingerprints = [(type(o).__qualname__, fingerprint(o)) for o in objects_of(*base_sink.objects)]
            base_sink.objects.clear()  # a live optimizer of another run would be diagnosed too (rightly)
            gc.collect()
            before = global_state()
            with run_sink.installed(), contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                code = main(["run", "--every", "1", "--activations", "--log-dir", str(tmp / "log"),
                             "--json", str(tmp / "report.json"), script_path(script), str(tmp / "run.pt"), arg])
            after = global_state()
            cache[(script, arg)] = RunOutcome(
                code, base, torch.load(tmp / "run.pt"), json.loads((tmp / "report.json").read_text()), before, after,
                base_fingerprints, [(type(o).__qualname__, fingerprint(o)) for o in objects_of(*run_sink.objects)],
                leftovers(*run_sink.objects))
            run_sink.objects.clear()  # nothing of this run may be alive when the next case runs
            gc.collect()
        return cache[(script, arg)]

    yield get
    cache.clear()


@pytest.mark.parametrize("script, arg, steps", RUN_CASES, ids=_RUN_IDS)
def test_ampdoctor_run_leaves_the_script_bitwise_identical(script, arg, steps, run_outcome):
    outcome = run_outcome(script, arg)
    assert outcome.code == 0
    assert_same_training(outcome.base, outcome.result)
    assert_same_globals(outcome.globals_before, outcome.globals_after)
    # the doctor did watch every step, with nothing going wrong inside it
    watch = outcome.report["watch"]
    assert (watch["steps"], watch["sampled_steps"]) == (steps, steps)
    assert [f["detail"] for f in outcome.report["findings"] if f["code"] == "AMP001"] == []


@pytest.mark.parametrize("script, arg, steps", RUN_CASES, ids=_RUN_IDS)
def test_ampdoctor_run_leaves_nothing_on_the_training_objects(script, arg, steps, run_outcome):
    outcome = run_outcome(script, arg)
    assert outcome.leftovers == []
    assert outcome.base_fingerprints == outcome.run_fingerprints


def test_ampdoctor_run_watches_an_accelerate_loop(tmp_path, capsys):
    gc.collect()
    code = main(["run", "--every", "1", "--json", str(tmp_path / "report.json"), script_path("accelerate_loop.py"),
                 str(tmp_path / "run.pt"), "bf16"])
    capsys.readouterr()
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0
    assert [f["detail"] for f in report["findings"] if f["code"] == "AMP001"] == []
    assert report["watch"]["steps"] == 10


class _Trainer:
    """What training frameworks build: an object graph with a cycle (Lightning's trainer <-> module), so the
    objects of a finished run are freed only by the cyclic garbage collector, whenever it runs next."""

    def __init__(self, model, opt, scaler) -> None:
        self.model, self.opt, self.scaler = model, opt, scaler
        self.callbacks = [self]


def test_doctor_ignores_garbage_from_earlier_runs(tmp_path, capsys):
    """A second run in one process (a notebook, a sweep, a test session): the first run's optimizer and scaler are
    unreachable cyclic garbage that gc has not collected yet. The doctor must not diagnose or watch them."""
    gc.collect()
    gc.disable()  # deterministic: the garbage stays until something collects it (the doctor should)
    try:
        model, opt, scaler, _ = load_script("amp_loop.py")["train"]("fused")
        _Trainer(model, opt, scaler)  # a finished run: unreachable, in a cycle
        del model, opt, scaler
        code = main(["run", "--every", "1", "--json", str(tmp_path / "report.json"), script_path("amp_loop.py"),
                     str(tmp_path / "run.pt"), "bf16-weights"])
    finally:
        gc.enable()
    capsys.readouterr()
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0
    assert [f["code"] for f in report["findings"] if f["code"] in ("AMP102", "AMP301")] == []  # no GradScaler here
    assert report["watch"]["steps"] == 12


# ---- nothing kept alive --------------------------------------------------------------------------------------------

def test_watch_does_not_keep_the_training_objects_alive(tmp_path):
    train = load_script("amp_loop.py")["train"]
    attach, watches = watch_all(log_dir=str(tmp_path))
    model, opt, scaler, _ = train("foreach", attach=attach)
    refs = [weakref.ref(o) for o in (model, opt, scaler, *model.parameters())]
    del model, opt, scaler
    gc.collect()
    w = watches[0]  # the detached watch stays usable for its results
    assert w.findings() and w.summary_data()["steps"] == 12
    assert [r for r in refs if r() is not None] == []


def test_watch_does_not_keep_the_objects_alive_after_an_internal_error(monkeypatch):
    from ampdoctor.monitor.grad_stats import GradStats

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(GradStats, "compute", broken)
    attach, watches = watch_all()
    model, opt, scaler, _ = load_script("amp_loop.py")["train"]("foreach", attach=attach)
    refs = [weakref.ref(o) for o in (model, opt, scaler)]
    del model, opt, scaler
    gc.collect()
    assert "AMP001" in codes(watches[0].findings())
    assert [r for r in refs if r() is not None] == []


def test_ampdoctor_run_does_not_keep_the_training_objects_alive(tmp_path, capsys):
    sink = Sink(weak=True)
    with sink.installed():
        code = main(["run", "--every", "1", "--activations", script_path("amp_loop.py"), str(tmp_path / "run.pt")])
    capsys.readouterr()
    gc.collect()
    assert code == 0 and len(sink.objects) == 4
    assert [r() for r in sink.objects if r() is not None] == []


def test_a_detached_doctor_does_not_keep_the_training_objects_alive(tmp_path, capsys):
    """The Doctor object outlives the run (its report is read after); the model, optimizer and scaler must not."""
    sink = Sink(weak=True)
    doctor = Doctor(RunOptions(every=1, activations=True))
    with sink.installed():
        result = run_script(script_path("amp_loop.py"), [str(tmp_path / "run.pt")], doctor)
    capsys.readouterr()
    gc.collect()
    assert result.exit_code == 0 and len(sink.objects) == 4
    assert "AMP601" in result.report.codes()
    alive = [type(r()).__name__ for r in sink.objects if r() is not None]
    assert alive == [], f"{alive} kept alive by the detached Doctor"


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="needs a C++ compiler: torch.compile's inductor builds its CPU kernels with one")
@pytest.mark.parametrize("options", [(), ("--activations",)], ids=["defaults", "activations"])
def test_ampdoctor_run_leaves_a_compiled_model_bitwise_identical(options, tmp_path, capsys):
    """The watch looks at the activations of its first steps on the defaults (every sampled step with --activations)
    through forward hooks. Traced into an inductor graph, a hook that reads a module's output makes the graph store
    it, which changes the fusions and the numbers (the losses differed in the 5th digit); and dynamo warned about
    our code on the console. The hooks now return at once while dynamo traces them."""
    base = run_script_plain("compiled_loop.py", tmp_path / "base.pt")
    gc.collect()
    code = main(["run", *options, "--json", str(tmp_path / "report.json"), script_path("compiled_loop.py"),
                 str(tmp_path / "run.pt")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert_same_training(base, torch.load(tmp_path / "run.pt"))
    assert "Dynamo" not in err and "ampdoctor/monitor" not in err, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["watch"]["steps"] == 6 and not report["watch"]["off"], report["watch"]


def test_torchs_warnings_name_the_scripts_line_not_ampdoctors_wrapper(tmp_path, capsys):
    """torch warns with stacklevel=2 from observed functions (a 'cuda' GradScaler built without CUDA; the
    scheduler stepped first): plainly the warning names the line of the caller; under ampdoctor it named
    ampdoctor/core/patch.py, the observer's wrapper. It must name what python names."""
    script = tmp_path / "warns.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(2, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "sched = torch.optim.lr_scheduler.StepLR(opt, 1)\n"
        "scaler = torch.amp.GradScaler('cpu')\n"
        "scaler.scale(model(torch.ones(1, 2)).sum()).backward()\n"
        "sched.step()  # before the optimizer: torch warns, naming this line\n"
        "scaler.step(opt)\n"
        "scaler.update()\n")
    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        runpy.run_path(str(script), run_name="__main__")
    with warnings.catch_warnings(record=True) as watched:
        warnings.simplefilter("always")
        assert main(["run", str(script)]) == 0
    capsys.readouterr()
    where = lambda ws: sorted((w.filename, w.lineno) for w in ws if "lr_scheduler.step()" in str(w.message))  # noqa: E731
    assert where(plain) == [(str(script), 7)]
    assert where(watched) == where(plain)
    assert not [w for w in watched if "ampdoctor" in w.filename], [(w.filename, str(w.message)) for w in watched]
