"""Objects that own parameters or mixed precision themselves: FSDP's policies, DDP wrappers, and the DeepSpeed,
Megatron and apex engines.

Nothing is imported here. FSDP2's policy and mesh are read through ``_get_fsdp_state()`` (torch 2.13; without it the
answer is None, "unknown"). DDP wrappers and third-party engine objects are found in one garbage-collector scan that
runs only when their package is loaded (DDP: only while a process group is initialised). DeepSpeed, Megatron-LM and
apex are recognised by the modules of the real objects' classes (``deepspeed.runtime.engine.DeepSpeedEngine``,
``megatron.core.optimizer.MixedPrecisionOptimizer``, ``apex.fp16_utils.FP16_Optimizer``...), never imported.
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

ENGINE_PACKAGES = {"deepspeed": "DeepSpeed", "megatron": "Megatron-LM", "apex": "apex"}
# where each engine keeps the model's half parameters it owns (DeepSpeed ZeRO, Megatron, apex FP16_Optimizer)
_HALF_GROUPS = ("bit16_groups", "fp16_groups", "float16_groups", "fp16_partitioned_groups")
_WRAPS = ("optimizer", "_optimizer", "module")


def fsdp2_policy(module: Any) -> tuple[torch.dtype | None, torch.dtype | None] | None:
    """Return ``(param_dtype, reduce_dtype)`` of an FSDP2 module's ``MixedPrecisionPolicy``, None if unknown."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if not callable(get_state):
        return None
    try:
        policy = getattr(get_state(), "_mp_policy", None)
    except Exception:   # not initialised yet, or a torch that changed the state object
        return None
    if policy is None:
        return None
    param, reduce = getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None)
    return (param if isinstance(param, torch.dtype) else None, reduce if isinstance(reduce, torch.dtype) else None)


def fsdp2_reduce_size(module: Any) -> int | None:
    """Return how many ranks an FSDP2 module's gradient reduction spans (shard × replicate), None if unknown."""
    try:
        groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or []
        info = groups[0].mesh_info
    except Exception:   # no parameters, not initialised, or another torch
        return None
    size = 1
    for attr in ("shard_mesh_size", "replicate_mesh_size"):
        value = getattr(info, attr, None)
        if isinstance(value, int):
            size *= value
    return size


def _scan(keep: Any) -> list[Any]:
    gc.collect()
    with warnings.catch_warnings():   # isinstance() on deprecated proxies warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if keep(o)]


def ddp_wrappers(params: Iterable[torch.Tensor]) -> list[nn.Module]:
    """Return the live ``DistributedDataParallel`` modules that hold any of ``params``.

    DDP's reducer buckets were built for the parameters' dtypes when it was constructed, so nothing may change
    their dtype or swap their ``.data``/``.grad`` afterwards. Only scans while a process group is initialised (DDP
    cannot be built without one).
    """
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    ids = {id(p) for p in params}
    if not ids:
        return []
    ddp = torch.nn.parallel.DistributedDataParallel
    # a DDP still in its __init__ (ampdoctor's --fix runs just before it) has no .module and no buckets yet
    return [m for m in _scan(lambda o: isinstance(o, ddp))
            if isinstance(getattr(m, "module", None), nn.Module) and any(id(p) in ids for p in m.module.parameters())]


def engine_family(obj: Any) -> str | None:
    """Return ``"DeepSpeed"``, ``"Megatron-LM"`` or ``"apex"`` when ``obj``'s class comes from that package.

    >>> engine_family(torch.nn.Linear(2, 2)) is None
    True
    """
    return _family_of(type(obj))


# Weak keys: a strong cache would keep every class alive, and with it a script's globals (its model) via methods.
_FAMILY: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def _family_of(cls: type) -> str | None:
    try:
        return _FAMILY[cls] or None
    except (KeyError, TypeError):
        pass
    family = ""
    for base in cls.__mro__:
        module = base.__dict__.get("__module__", "")
        top = module.split(".", 1)[0] if isinstance(module, str) else ""   # some builtins keep a descriptor here
        if top in ENGINE_PACKAGES:
            family = ENGINE_PACKAGES[top]
            break
    try:
        _FAMILY[cls] = family
    except TypeError:   # a class that takes no weak reference
        pass
    return family or None


def loaded_engine_packages() -> list[str]:
    """Return the engine packages imported in this process."""
    return [name for name in ENGINE_PACKAGES if name in sys.modules]


@dataclass
class Engine:
    """One engine object and what it owns.

    Attributes:
        family: ``"DeepSpeed"``, ``"Megatron-LM"`` or ``"apex"``.
        obj: the engine object (a ``DeepSpeedEngine``, a ``MixedPrecisionOptimizer``, an ``FP16_Optimizer``...).
        optimizers: ids of the torch optimizers it wraps (they step its fp32 copies).
        params: ids of the model parameters it owns (its modules' and its half groups').
        precision: what it says of its own precision (``fp16 enabled``, ``dynamic loss scale``...).
    """

    family: str
    obj: Any
    optimizers: set[int] = field(default_factory=set)
    params: set[int] = field(default_factory=set)
    precision: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        cls = type(self.obj)
        return f"{cls.__module__}.{cls.__name__}"


def _call(obj: Any, name: str) -> Any:
    fn = getattr(obj, name, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except Exception:   # an engine that is not set up for this query
        return None


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())   # an engine's scale is a scalar; this runs once, before training
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _precision(obj: Any) -> list[str]:
    """Read what an engine says of its own precision, where that is cheap (config flags, the current scale)."""
    said: list[str] = []
    config = getattr(obj, "config", None)
    for name, text in (("fp16_enabled", "fp16 enabled"), ("bfloat16_enabled", "bf16 enabled")):
        if _call(obj, name):    # DeepSpeedEngine
            said.append(text)
    for name in ("fp16", "bf16"):   # Megatron's OptimizerConfig
        if getattr(config, name, None) is True:
            said.append(f"{name} enabled")
    stage = _number(_call(obj, "zero_optimization_stage"))
    if stage is not None:
        said.append(f"ZeRO stage {stage:g}")
    configured = _number(_call(obj, "loss_scale")) if hasattr(obj, "fp16_enabled") else None
    if configured is not None:   # DeepSpeedEngine.loss_scale() is the config value: 0 means dynamic
        said.append("dynamic loss scale" if configured == 0 else f"static loss scale {configured:g}")
    elif isinstance(getattr(obj, "dynamic_loss_scale", None), bool):   # apex / DeepSpeed FP16_Optimizer
        said.append("dynamic loss scale" if obj.dynamic_loss_scale else "static loss scale")
    current = None
    for holder in (obj, getattr(obj, "optimizer", None), getattr(obj, "loss_scaler", None)):
        current = current if current is not None else _number(getattr(holder, "cur_scale", None))
    current = current if current is not None else _number(_call(obj, "get_loss_scale"))   # Megatron
    if current is not None:
        said.append(f"current loss scale {current:g}")
    return said


def _owned(engine: Engine, obj: Any, depth: int = 0) -> None:
    """Collect what ``obj`` (the engine or an object it wraps) owns, following ``optimizer``/``module`` links."""
    if depth > 4 or obj is None:
        return
    if isinstance(obj, torch.optim.Optimizer):
        engine.optimizers.add(id(obj))
    if isinstance(obj, nn.Module):
        engine.params.update(id(p) for p in obj.parameters())
    for attr in _HALF_GROUPS:
        for group in getattr(obj, attr, None) or ():
            engine.params.update(id(t) for t in (group if isinstance(group, (list, tuple)) else [group])
                                 if isinstance(t, torch.Tensor))
    for attr in _WRAPS:
        inner = getattr(obj, attr, None) if not isinstance(obj, torch.optim.Optimizer) else None
        if inner is not None and inner is not obj:
            _owned(engine, inner, depth + 1)


def describe_engine(obj: Any) -> Engine | None:
    """Return what the engine object ``obj`` owns and says of its precision; None when it is not one."""
    family = engine_family(obj)
    if family is None:
        return None
    engine = Engine(family, obj, precision=_precision(obj))
    _owned(engine, obj)
    return engine


def find_engines(models: Iterable[nn.Module], optimizers: Iterable[Any], given: Iterable[Any] = (),
                 params: Iterable[torch.Tensor] = ()) -> list[Engine]:
    """Return the engines behind ``models``, ``optimizers`` and ``params``: engine modules inside the models, the
    engine objects ``given`` (wrappers passed to ``check()``), and, when an engine package is loaded, the live
    engine objects that wrap one of the optimizers or hold one of the parameters.
    """
    found: dict[int, Any] = {id(o): o for o in given if engine_family(o)}
    models = list(models)
    for model in models:
        for module in model.modules():
            if engine_family(module):
                found.setdefault(id(module), module)
                break   # the outermost engine module owns the ones inside it
    if loaded_engine_packages():
        wanted = ({id(o) for o in optimizers} | {id(p) for m in models for p in m.parameters()}
                  | {id(p) for p in params})
        for obj in _scan(lambda o: _family_of(type(o)) is not None and not isinstance(o, type)):
            engine = describe_engine(obj)
            if engine is not None and (engine.optimizers | engine.params) & wanted:
                found.setdefault(id(obj), obj)
    engines = [e for e in (describe_engine(o) for o in found.values()) if e is not None]
    # an engine object wrapped by another one (DeepSpeedEngine -> DeepSpeedZeroOptimizer) is part of the outer one
    inner = {id(getattr(e.obj, a, None)) for e in engines for a in _WRAPS}
    return [e for e in engines if id(e.obj) not in inner] or engines


def unwrap_engine_optimizer(obj: Any) -> torch.optim.Optimizer | None:
    """Return the torch optimizer inside an engine's optimizer wrapper (``DeepSpeedZeroOptimizer.optimizer``)."""
    for _ in range(4):
        obj = getattr(obj, "optimizer", None)
        if isinstance(obj, torch.optim.Optimizer):
            return obj
    return None
