"""Every probe of the two rooms (``ampdoctor._torch``, ``ampdoctor._compat``) works on the installed versions, and
its stated fallback answers as its docstring says.

A rename in torch or in a library shows up here as one failing test. Fallbacks are exercised where the condition
can be made real in-process: a feature switched off on the probe module (``monkeypatch``: the probe's own switch,
never torch), an object that lacks the internal, or a process that never imported the library. Not exercised: a
module class without ``_parameters``/``_modules`` (nn.Module cannot run without them) and an autograd engine without
``queue_callback``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor._compat import accelerate as compat_accelerate
from ampdoctor._compat import engines as compat_engines
from ampdoctor._compat import lightning as compat_lightning
from ampdoctor._compat import ray as compat_ray
from ampdoctor._compat import transformers as compat_transformers
from ampdoctor._torch import autograd, dispatch, distributed, engines, foreach, frames, modules, optim, scaler

SRC = Path(__file__).resolve().parents[2] / "src" / "ampdoctor"
LIBRARIES = ("accelerate", "transformers", "lightning", "pytorch_lightning", "deepspeed", "peft", "diffusers", "ray")


@pytest.mark.parametrize("module", sorted(
    ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
    for room in ("_torch", "_compat") for p in (SRC / room).glob("*.py")))
def test_every_probe_module_imports_on_the_installed_versions(module):
    __import__(module)


def test_importing_ampdoctor_and_its_rooms_imports_no_library():
    code = ("import sys, ampdoctor, ampdoctor.runner.doctor, ampdoctor.monitor.watcher, ampdoctor.explanations.crash\n"
            "import ampdoctor._compat.accelerate, ampdoctor._compat.transformers, ampdoctor._compat.lightning\n"
            "import ampdoctor._compat.engines, ampdoctor._compat.ray\n"
            f"print(sorted(m for m in {LIBRARIES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"


# ---- torch ---------------------------------------------------------------------------------------------------------
def test_foreach_fallbacks_give_the_values_of_the_multi_tensor_kernels(monkeypatch):
    tensors = [torch.tensor([3.0, -4.0]), torch.tensor([0.5, 2.0, -8.0], dtype=torch.float16)]
    fast = [n.item() for n in foreach.norms(tensors, 2.0, dtype=torch.float32)]
    fast_inf = [n.item() for n in foreach.norms(tensors, float("inf"))]
    for switch in ("_NORM", "_COPY", "_ADD", "_ZERO"):
        monkeypatch.setattr(foreach, switch, None)
    assert [n.item() for n in foreach.norms(tensors, 2.0, dtype=torch.float32)] == fast
    assert [n.item() for n in foreach.norms(tensors, float("inf"))] == fast_inf == [4.0, 8.0]
    out = [torch.zeros(2), torch.zeros(3)]
    foreach.copy_(out, tensors)
    foreach.add_(out, tensors)
    assert [t.tolist() for t in out] == [[6.0, -8.0], [1.0, 4.0, -16.0]]
    foreach.zero_(out)
    assert all(not t.any() for t in out)
    assert foreach.norms([]) == []


def test_dispatch_fallbacks_walk_containers_and_name_no_schema(monkeypatch):
    tree = ((torch.ones(1), [torch.zeros(2), 3]), {"a": torch.ones(3)})
    with_pytree = dispatch.tree_leaves(tree)
    monkeypatch.setattr(dispatch, "_pytree_leaves", None)
    assert [id(x) for x in dispatch.tree_leaves(tree)] == [id(x) for x in with_pytree]
    assert dispatch.op_schema(len) is None and dispatch.op_writes_in_place(len) is False
    assert dispatch.dispatch_modes_available()


def test_module_probes_see_torch_compile_and_ddp_style_wrappers():
    model = nn.Sequential(nn.Linear(2, 2))
    compiled = torch.compile(model)   # built lazily: nothing compiles until it is called
    assert modules.is_delegating_wrapper(compiled) and modules.delegate_of(compiled) is model
    assert modules.delegate_of(model) is None and not modules.is_delegating_wrapper(model)
    model.register_parameter("unused", None)
    assert [type(m).__name__ for m in modules.own_children(model)] == ["Linear"]
    assert list(modules.own_parameters(model)) == []


def test_autograd_probes_inside_and_outside_a_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: seen.append((autograd.in_backward(), autograd.queue_backward_callback(lambda: None))))
    (x * 2).sum().backward()
    assert seen == [(True, True)] and not autograd.in_backward()
    assert autograd.version_counter(x) == 0


def test_scaler_probes_on_a_duck_typed_scaler_answer_unknown():
    duck = object()
    assert scaler.stage(duck, object()) is scaler.OptState.READY
    assert scaler.found_inf_flags(duck) == {} and scaler.live_scale(duck) is None
    assert scaler.growth_tracker(duck) is None and scaler.init_scale(duck) is None
    assert scaler.scaler_device(duck) is None and not scaler.has_state_machine(duck)
    real = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert scaler.has_state_machine(real) and scaler.init_scale(real) == 8.0 and scaler.scaler_device(real) == "cpu"
    assert optim.scheduler_step_count(object()) is None


def test_frame_probes_on_real_frames():
    def clip_grad_norm_(parameters):   # a frame named like torch's, holding the list torch makes
        return sys._getframe()

    frame = clip_grad_norm_([torch.ones(1)])
    assert len(frames.clip_parameters(frame)) == 1
    here = sys._getframe()
    assert frames.clip_parameters(here) is None and frames.autocast_decorator(here) is None
    assert frames.scaler_frame_tensors(here) == (None, None) and frames.frame_self(here) is None
    assert ("frame", frame) in frames.frame_values(here)
    assert frames.generator_module(iter([])) is None


def test_frame_probes_read_torch_s_autocast_decorator():
    found = []

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward():
        caller = sys._getframe(1)   # torch's decorate_autocast
        found.append(frames.autocast_decorator(caller))

    forward()
    assert isinstance(found[0], torch.autocast) and found[0].fast_dtype == torch.bfloat16


def test_distributed_and_fsdp_probes_without_a_process_group():
    assert distributed.distributed_world() == 1 and distributed.process_rank() is None
    assert not distributed.runs_collectives(nn.Linear(2, 2), engine=lambda m: True)
    assert not distributed.is_flat_param(nn.Parameter(torch.ones(1))) and distributed.flat_param_padding(1) == 0
    assert engines.fsdp2_policy(nn.Linear(2, 2)) is None and engines.fsdp2_reduce_size(nn.Linear(2, 2)) is None
    assert engines.ddp_wrappers([torch.ones(1)]) == []


# ---- other libraries -----------------------------------------------------------------------------------------------
def test_accelerate_probes_on_a_real_accelerator():
    accelerate = pytest.importorskip("accelerate")
    assert compat_accelerate.accelerator_autocast(None) is None
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reloads = []   # asked from inside each load_state_dict, as ampdoctor's observer asks
    optimizer.register_load_state_dict_pre_hook(
        lambda opt, state: reloads.append(compat_accelerate.is_placement_reload(opt)))
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    assert compat_accelerate.accelerator_built()
    prepared, _ = accelerator.prepare(model, optimizer)
    assert reloads == [True] and compat_accelerate.prepared_forward(prepared)
    assert compat_accelerate.accelerator_autocast(accelerator) == torch.bfloat16
    optimizer.load_state_dict(optimizer.state_dict())   # the user's own load: not accelerate's reload
    assert reloads == [True, False]


def test_accelerate_probe_without_accelerate_or_its_state(monkeypatch):
    for name in ("accelerate", "accelerate.state", "accelerate.optimizer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not compat_accelerate.accelerator_built()
    assert not compat_accelerate.is_placement_reload(torch.optim.SGD([torch.zeros(1)], lr=0.1))


def test_transformers_probes():
    assert compat_transformers.calling_trainer() is None
    assert compat_transformers.epoch_method(object()) == "training_step"
    transformers = pytest.importorskip("transformers")
    assert hasattr(transformers.Trainer, "_run_epoch")   # what epoch_method finds on a real Trainer
    assert compat_transformers.calling_trainer() is None   # no Trainer among the calling frames


def test_lightning_probes_on_real_fabric_and_trainer_objects():
    lightning = pytest.importorskip("lightning")
    model = nn.Linear(2, 2)
    wrapped = lightning.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed").setup_module(model)
    assert compat_lightning.is_fabric_module(wrapped) and compat_lightning.fabric_module_of(wrapped) is model
    assert compat_lightning.fabric_autocast(wrapped) == torch.bfloat16
    half = lightning.Fabric(accelerator="cpu", devices=1, precision="bf16-true").setup_module(nn.Linear(2, 2))
    assert compat_lightning.fabric_autocast(half) is None   # HalfPrecision casts the module: no autocast
    options = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    plain = lightning.Trainer(devices=1, **options)
    spawn = lightning.Trainer(devices=2, strategy="ddp_spawn", **options)   # nothing starts before fit()
    assert not compat_lightning.spawned_worker(plain) and compat_lightning.spawned_worker(spawn)
    assert compat_lightning.stage_method(plain) == "_run_stage" and compat_lightning.stage_method(object()) is None
    assert compat_lightning.fabric_module_of(model) is None and not compat_lightning.spawned_worker(object())


def test_ray_probe_reads_no_worker_in_this_process_with_or_without_ray(monkeypatch):
    pytest.importorskip("ray.train")
    assert compat_ray.in_train_worker() is False   # get_context() raises outside a training function
    monkeypatch.delitem(sys.modules, "ray.train")
    assert compat_ray.in_train_worker() is False
    # inside a TorchTrainer worker it is True: tests/integrations/test_ray.py


def test_engine_recognition_by_the_module_of_a_class():
    apex_like = type("FP16_Optimizer", (), {"__module__": "apex.fp16_utils.fp16_optimizer"})
    assert compat_engines.engine_family(apex_like()) == "apex"
    assert compat_engines.engine_family(nn.Linear(2, 2)) is None
    assert compat_engines.describe_engine(nn.Linear(2, 2)) is None
    assert set(compat_engines.loaded_engine_packages()) <= set(compat_engines.ENGINE_PACKAGES)
