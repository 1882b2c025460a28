"""The engines of other libraries that own parameters and mixed precision themselves: DeepSpeed, Megatron-LM, apex.

Nothing is imported here. An engine is recognised by the modules of its object's class and of the bases
(``deepspeed.runtime.engine.DeepSpeedEngine``, ``megatron.core.optimizer.MixedPrecisionOptimizer``,
``apex.fp16_utils.FP16_Optimizer``...), so a process that never imported one is never made to, and the live engine
objects are looked for in one garbage-collector scan (``ampdoctor._torch.engines.live_objects``) only when one of
the packages is loaded. What an engine owns and says of its precision is read from attributes that DeepSpeed 0.19,
Megatron-LM core and apex set (their config flags, half groups, fp32 flat partitions, the ``optimizer`` each wraps);
an attribute that is missing reads as "not known": no mode (None), no owned tensors, no flat copies.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ampdoctor._torch.engines import live_objects

ENGINE_PACKAGES = {"deepspeed": "DeepSpeed", "megatron": "Megatron-LM", "apex": "apex"}
# where each engine keeps the model's half parameters it owns (DeepSpeed ZeRO, Megatron, apex FP16_Optimizer)
_HALF_GROUPS = ("bit16_groups", "fp16_groups", "float16_groups", "fp16_partitioned_groups")
_WRAPS = ("optimizer", "_optimizer", "module")


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
        params: ids of the tensors it owns: its modules' parameters, its half groups and their partitions.
        precision: what it says of its own precision (``fp16 enabled``, ``dynamic loss scale``...).
        mode: ``"fp16"``, ``"bf16"``, ``"autocast fp16"``, ``"autocast bf16"``, ``"fp32"`` (none enabled) or None
            (its settings were not readable).
        model_params: the parameters of the model it wraps (None when it wraps no module).
    """

    family: str
    obj: Any
    optimizers: set[int] = field(default_factory=set)
    params: set[int] = field(default_factory=set)
    precision: list[str] = field(default_factory=list)
    mode: str | None = None
    model_params: int | None = None

    @property
    def label(self) -> str:
        cls = type(self.obj)
        return f"{cls.__module__}.{cls.__name__}"

    @property
    def loss_scaled(self) -> bool:
        """Whether it scales the loss (fp16), as far as its settings tell (unknown settings: it may)."""
        return self.mode is None or "fp16" in self.mode


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


def _precision(obj: Any) -> tuple[list[str], str | None]:
    """Read what an engine says of its own precision, where that is cheap (config flags, the current scale), and
    which mode that is (see ``Engine.mode``)."""
    said, modes = _precision_flags(obj)
    # a DeepSpeedEngine answers both flags: neither enabled is fp32 training; other engines' flags may be absent
    readable = callable(getattr(obj, "fp16_enabled", None)) and callable(getattr(obj, "bfloat16_enabled", None))
    mode = modes[0] if modes else ("fp32" if readable else None)
    stage = _number(_call(obj, "zero_optimization_stage"))
    if stage is not None:
        said.append(f"ZeRO stage {stage:g}")
    if mode is not None and "fp16" not in mode:
        return said, mode   # bf16 and fp32 scale no loss: DeepSpeed's loss_scale() is an fp16 setting
    return said + _loss_scale(obj), mode


def _precision_flags(obj: Any) -> tuple[list[str], list[str]]:
    """Read an engine's precision flags: what they say, and the modes they enable."""
    said: list[str] = []
    modes: list[str] = []
    config = getattr(obj, "config", None)
    for name, mode in (("fp16_enabled", "fp16"), ("bfloat16_enabled", "bf16")):
        if _call(obj, name):    # DeepSpeedEngine
            said.append(f"{mode} enabled")
            modes.append(mode)
    for name in ("fp16", "bf16"):   # Megatron's OptimizerConfig
        if getattr(config, name, None) is True:
            said.append(f"{name} enabled")
            modes.append(name)
    if not modes and _call(obj, "torch_autocast_enabled"):   # DeepSpeed's "torch_autocast": fp32 parameters
        dtype = _call(obj, "torch_autocast_dtype")
        mode = f"autocast {'fp16' if dtype == torch.float16 else 'bf16'}"
        said.append(f"torch.autocast({str(dtype).replace('torch.', '')})" if isinstance(dtype, torch.dtype) else mode)
        modes.append(mode)
    return said, modes


def _loss_scale(obj: Any) -> list[str]:
    """Say how an fp16 engine scales the loss: dynamic or static, and its current scale."""
    said: list[str] = []
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
    said, mode = _precision(obj)
    engine = Engine(family, obj, precision=said, mode=mode)
    _owned(engine, obj)
    module = obj if isinstance(obj, nn.Module) else None
    inner = getattr(module, "module", None)
    if isinstance(inner, nn.Module):   # DeepSpeedEngine.module: the user's model
        engine.model_params = sum(1 for _ in inner.parameters())
    elif module is not None:
        engine.model_params = sum(1 for _ in module.parameters())
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
        for obj in live_objects(lambda o: _family_of(type(o)) is not None and not isinstance(o, type)):
            engine = describe_engine(obj)
            if engine is not None and (engine.optimizers | engine.params) & wanted:
                found.setdefault(id(obj), obj)
    engines = [e for e in (describe_engine(o) for o in found.values()) if e is not None]
    # an engine object wrapped by another one (DeepSpeedEngine -> DeepSpeedZeroOptimizer) is part of the outer one
    inner = {id(getattr(e.obj, a, None)) for e in engines for a in _WRAPS}
    engines = [e for e in engines if id(e.obj) not in inner] or engines
    # so are the helpers an engine module keeps for its parameters (ZeRO-3's DeepSpeedZeRoOffload and zero.Init):
    # of one family, an object that is not a module and shares tensors with an engine module is part of it
    modules = [e for e in engines if isinstance(e.obj, nn.Module)]
    return [e for e in engines if isinstance(e.obj, nn.Module) or not any(
        m.family == e.family and (m.params | m.optimizers) & (e.params | e.optimizers) for m in modules)]


def unwrap_engine_optimizer(obj: Any) -> torch.optim.Optimizer | None:
    """Return the torch optimizer inside an engine's optimizer wrapper (``DeepSpeedZeroOptimizer.optimizer``)."""
    for _ in range(4):
        obj = getattr(obj, "optimizer", None)
        if isinstance(obj, torch.optim.Optimizer):
            return obj
    return None


@dataclass(frozen=True)
class FlatCopy:
    """A tensor an engine's torch optimizer steps in place of the model's parameters: an fp32 master copy of a
    parameter group, flattened, whole on every rank or this rank's partition of it.

    Attributes:
        name: where the engine keeps it (``DeepSpeedZeroOptimizer.single_partition_of_fp32_groups[0]``).
        family: the engine's family (``"DeepSpeed"``).
        group: the process group over whose ranks the partitions split it; None when every rank holds it whole.
        padding: the zero entries the engine appended at its end on this rank (the last rank's partition).
    """

    name: str
    family: str
    group: Any = None
    padding: int = 0


# DeepSpeed optimizers' lists of fp32 flat tensors: (attribute, attribute of this rank's padding per group,
# partitioned over the data-parallel ranks). ZeRO-1/2 (DeepSpeedZeroOptimizer), BF16_Optimizer, ZeRO-3 (whose
# torch optimizer holds its partitions only inside step()), and FP16_Optimizer (no ZeRO: a whole copy per rank).
_FLAT_LISTS = (("single_partition_of_fp32_groups", "groups_padding", True),
               ("fp32_groups_flat_partition", "group_paddings", True),
               ("fp32_partitioned_groups_flat", None, True),
               ("fp32_groups_flat", None, False))


def engine_flat_copies(objects: Iterable[Any]) -> dict[int, FlatCopy]:
    """Return ``{id(tensor): FlatCopy}`` for the fp32 flat copies kept by the engine objects among ``objects`` and
    the engine optimizers they wrap (``DeepSpeedEngine.optimizer``), read from their attributes.

    >>> engine_flat_copies([torch.optim.SGD([torch.zeros(1)], lr=0.1)])
    {}
    """
    out: dict[int, FlatCopy] = {}
    for obj in _reachable(objects):
        family = engine_family(obj)
        if family is None:
            continue
        for attr, padding_attr, partitioned in _FLAT_LISTS:
            tensors = getattr(obj, attr, None)
            if not isinstance(tensors, (list, tuple)):
                continue
            paddings = getattr(obj, padding_attr, None) if padding_attr else None
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor):
                    continue
                group = _partition_group(obj, i) if partitioned else None
                pad = paddings[i] if isinstance(paddings, (list, tuple)) and i < len(paddings) else 0
                out[id(t)] = FlatCopy(f"{type(obj).__name__}.{attr}[{i}]", family, group,
                                      int(pad) if isinstance(pad, int) and 0 <= pad <= t.numel() else 0)
    return out


def _partition_group(obj: Any, i: int) -> Any:
    """Return the process group that group ``i``'s partitions split over, None when they are not split (one rank)."""
    counts = getattr(obj, "partition_count", None)
    count = counts[i] if isinstance(counts, (list, tuple)) and i < len(counts) else counts
    if isinstance(count, int) and count <= 1:
        return None
    groups = getattr(obj, "real_dp_process_group", None)
    group = groups[i] if isinstance(groups, (list, tuple)) and i < len(groups) else None
    return group if group is not None else getattr(obj, "dp_process_group", None)


def engine_stepper(objects: Iterable[Any], inner: Any) -> Any:
    """Return the engine optimizer among ``objects`` (and the objects they hold in ``.optimizer``) that steps the
    torch optimizer ``inner`` as part of its own ``step()``, None if there is none.

    DeepSpeed's ``DeepSpeedZeroOptimizer.step()`` calls ``inner.step()`` once per parameter group, with
    ``inner.param_groups`` set to that one group and only its fp32 partition holding a gradient; ZeRO-3 once per
    sub-group. One training step is then its ``step()``, not the torch optimizer's.

    >>> engine_stepper([torch.optim.SGD([torch.zeros(1)], lr=0.1)], None) is None
    True
    """
    return next((obj for obj in _reachable(objects)
                 if inner is not None and getattr(obj, "optimizer", None) is inner and engine_family(obj)
                 and callable(getattr(obj, "step", None)) and not isinstance(obj, torch.optim.Optimizer)), None)


def _reachable(objects: Iterable[Any]) -> Iterable[Any]:
    """Yield ``objects`` and the objects they hold in ``.optimizer``, recursively, each once (no tensors)."""
    stack, seen = list(objects), set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen or isinstance(obj, torch.Tensor):
            continue
        seen.add(id(obj))
        yield obj
        stack.append(getattr(obj, "optimizer", None))
