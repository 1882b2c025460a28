"""Models are what the optimizers train: parts called directly, several modules, folds, wrapped optimizers."""

import json
import os
import subprocess
import sys
import warnings

import torch
from torch import nn

from ampdoctor.runner.discovery import real_optimizers, trained_models
from ampdoctor.ui.cli import main

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def run_json(tmp_path, capsys, *argv):
    out = tmp_path / "report.json"
    code = main(["run", "--no-watch", "--json", str(out), *argv])
    captured = capsys.readouterr()
    return code, json.loads(out.read_text()), captured


def test_parts_called_directly_are_named_from_the_whole_model_without_false_amp301(tmp_path, capsys):
    code, report, _ = run_json(tmp_path, capsys, os.path.join(SCRIPTS, "parts_called_directly.py"))
    assert code == 1
    codes = [f["code"] for f in report["findings"]]
    assert "AMP301" not in codes
    amp101 = [f for f in report["findings"] if f["code"] == "AMP101"]
    assert len(amp101) == 1 and amp101[0]["where"] == "head" and "head.weight (float16" in amp101[0]["detail"]
    assert "param_groups" not in amp101[0]["detail"]


def test_actor_and_critic_under_one_optimizer_stay_quiet(tmp_path, capsys):
    code, report, captured = run_json(tmp_path, capsys, os.path.join(SCRIPTS, "actor_critic.py"))
    assert code == 0
    assert report["findings"] == [] and report["ok"] is True
    assert "ampdoctor: no mixed-precision problems found" in captured.err   # the verdict, earned
    assert report["observed"]["optimizers"] == 1


def test_fix_repairs_every_fold_not_only_the_first(tmp_path, capsys):
    code, report, captured = run_json(tmp_path, capsys, "--fix", os.path.join(SCRIPTS, "kfold_half.py"))
    assert code == 0, captured.err
    assert captured.out.count("fold 1 loss") == 4
    assert report["exception"] is None


def test_fix_migrates_the_state_of_every_optimizer(tmp_path, capsys):
    code, report, captured = run_json(tmp_path, capsys, "--fix", os.path.join(SCRIPTS, "two_optimizers_half.py"))
    assert code == 0, captured.err
    assert "state dtypes ['torch.float32']" in captured.out


class _Wrapper(torch.optim.Optimizer):
    """Delegates to a torch optimizer, as accelerate's AcceleratedOptimizer and Lightning's wrapper do."""

    def __init__(self, optimizer):  # no super().__init__(), like the real wrappers
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def test_a_wrapped_optimizer_is_one_optimizer():
    model = nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = _Wrapper(_Wrapper(inner))
    assert real_optimizers([outer, outer.optimizer, inner]) == [inner]
    assert real_optimizers([inner, outer]) == [inner]


def test_models_are_the_outermost_owners_of_trained_parameters():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))

    net, ema = Net(), Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    modules = list(net.modules()) + list(ema.modules())
    # the step called a part directly; the EMA copy ran a forward too but no optimizer trains it
    assert trained_models([net.net[2], ema], [opt], modules) == [net]
    from ampdoctor.core.training import TrainingSetup

    names = [p.name for p in TrainingSetup(trained_models([net.net[2]], [opt], modules), opt).params]
    assert names == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]  # the prefix is kept
    # a model whose forward was never seen is found through its optimizer
    assert trained_models([], [opt], modules) == [net]


def test_delegating_wrappers_do_not_prefix_the_names():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    wrapped = torch.nn.DataParallel(net)   # like DDP (`module.`), Fabric (`_forward_module.`), torch.compile
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    modules = list(wrapped.modules())
    assert trained_models([wrapped], [opt], modules) == [net]
    assert trained_models([net[2]], [opt], modules) == [net]


def test_an_optimizer_per_parameter_is_one_amp103_and_the_watch_says_what_it_covers(tmp_path):
    # torchtune's optimizer in backward: 4 AdamW, one per bf16 parameter. Pre-flight: one AMP103 for all of them,
    # not one per parameter. The watch follows one optimizer, so its tables cover 1 of the 4 tensors: it says so.
    # In a process of its own: the script's tensor hooks hold its model and optimizers in a cycle that the garbage
    # collector does not free, and later in-process runs of this test session would find them.
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--json", str(out),
                           os.path.join(SCRIPTS, "optimizer_in_backward.py")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report, err = json.loads(out.read_text()), done.stderr
    assert done.returncode == 0, err
    [amp103] = report["findings"]
    assert amp103["code"] == "AMP103" and amp103["where"] == "4 optimizers", amp103
    assert amp103["detail"].startswith("4 AdamW optimizers (as when each parameter has its own")
    assert "update 4 of 4" in amp103["detail"]
    assert report["watch"]["coverage"] == {"optimizer": "optimizer[0] (AdamW)", "other_optimizers": 3,
                                           "trainable": 4, "tensors": 1}
    assert "watched: the 1 of 4 trainable tensors that optimizer[0] (AdamW) steps; 3 other\n    optimizers are " \
        "not watched" in err


def test_a_compiled_model_gets_no_warning_about_ampdoctors_hooks(tmp_path, capsys):
    # torch.compile warns on the first call while any global module hook exists; ampdoctor's discovery hooks are
    # global, so every compiled script printed "Using `torch.compile(module)` when there are global hooks".
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, report, captured = run_json(tmp_path, capsys, os.path.join(SCRIPTS, "compiled_model.py"))
    assert code == 0 and report["findings"] == [], captured.err
    assert [str(w.message) for w in seen if "global hooks" in str(w.message)] == []
    assert report["observed"]["models"] == 1
    # a global hook of the user's keeps torch's warning
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run_json(tmp_path, capsys, os.path.join(SCRIPTS, "compiled_model.py"))
    finally:
        handle.remove()
    assert [w for w in seen if "global hooks" in str(w.message)]


def test_two_models_with_two_optimizers_the_watch_says_it_follows_one(tmp_path, capsys):
    # The PyTorch AMP example with two models and two optimizers under one GradScaler: the watch follows
    # optimizer[0], so its tables cover model0 only; it says so instead of leaving model1 out silently.
    out = tmp_path / "report.json"
    code = main(["run", "--json", str(out), os.path.join(SCRIPTS, "amp_multiple_models.py")])
    report, err = json.loads(out.read_text()), capsys.readouterr().err
    assert code == 0 and report["findings"] == [], err
    assert report["observed"]["models"] == 2 and report["observed"]["optimizers"] == 2
    assert report["watch"]["coverage"] == {"optimizer": "optimizer[0] (SGD)", "other_optimizers": 1,
                                           "trainable": 8, "tensors": 4}
    assert "watched: the 4 of 8 trainable tensors that optimizer[0] (SGD) steps; 1 other\n    optimizer is not " \
        "watched" in err


def test_zero_redundancy_optimizer_is_one_optimizer_not_two(tmp_path, capsys):
    # ZeroRedundancyOptimizer steps its own per-rank AdamW inside its step. Counted as a second optimizer, it was
    # "1 other optimizer is not watched", and, never diagnosed, it sent the Doctor back to a scan on every step.
    out = tmp_path / "report.json"
    code = main(["run", "--json", str(out), os.path.join(SCRIPTS, "zero_optimizer.py")])
    report, err = json.loads(out.read_text()), capsys.readouterr().err
    assert code == 0 and report["findings"] == [], err
    assert report["observed"] == {"models": 1, "optimizers": 1, "scalers": 1}
    assert "coverage" not in report["watch"] and "not watched" not in err
    assert report["watch"]["sampled_steps"] == 6


def test_the_watch_follows_the_dense_model_not_a_sparse_embedding(tmp_path, capsys):
    # The sparse embedding is the larger model, but its gradients are sparse and cannot be summarised: watching it
    # showed no gradient table at all. The dense head is watched, and the summary says what is left out.
    out = tmp_path / "report.json"
    code = main(["run", "--json", str(out), os.path.join(SCRIPTS, "sparse_embedding.py")])
    report, err = json.loads(out.read_text()), capsys.readouterr().err
    assert code == 0 and report["findings"] == [], err
    assert report["watch"]["coverage"] == {"optimizer": "optimizer[1] (AdamW)", "other_optimizers": 1,
                                           "trainable": 5, "tensors": 4}
    # two models: named as the findings name them, after the script's own names for the models
    assert sorted(report["watch"]["gradients"]["params"]) == ["head.0.bias", "head.0.weight", "head.2.bias",
                                                               "head.2.weight"]


def test_a_later_folds_watch_covers_its_own_model_not_the_ended_folds(tmp_path, capsys):
    # each fold's watch is a stage of its own; the earlier folds' optimizers (held by the run's own records, gone
    # from the script) were "2 other optimizers are not watched", and the fold's model was named model[0]
    out = tmp_path / "report.json"
    code = main(["run", "--json", str(out), os.path.join(SCRIPTS, "kfold_scaled.py")])
    report, err = json.loads(out.read_text()), capsys.readouterr().err
    assert code == 0 and report["findings"] == [], err
    assert report["observed"]["optimizers"] == 3 and "2 earlier stages" in err
    assert "coverage" not in report["watch"] and "not watched" not in err
    assert sorted(report["watch"]["gradients"]["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_an_ended_stages_optimizer_is_left_out_until_it_steps_again():
    import weakref

    from ampdoctor.core.options import RunOptions
    from ampdoctor.runner.doctor import Doctor
    from ampdoctor.session.stages import Stages

    torch.manual_seed(0)
    x = torch.randn(8, 4)
    old = nn.Linear(4, 4).half()   # a crashed cell's traceback still holds them (a notebook)
    old_opt = torch.optim.SGD(old.parameters(), lr=0.1)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ended = weakref.WeakSet([old_opt])
    with Doctor(RunOptions(watch=False), stages=Stages(ended=ended)) as doctor:
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        assert doctor.setup.optimizers == [opt] and doctor.setup.models == [model]
        assert "AMP103" not in doctor.report.codes()   # the old half model is not this stage's
        old(x.half()).float().sum().backward()
        old_opt.step()   # it trains again: this stage's from now on
        assert old_opt not in ended and old_opt in doctor.setup.optimizers
    assert "AMP103" in doctor.report.codes()
