"""The training objects under examination, gathered once with the names users know them by."""

from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from ampdoctor.core.dtypes import HALF, LOW_PRECISION, dtype_name

__all__ = ["HALF", "LOW_PRECISION", "ParamInfo", "TrainingSetup", "group_by_module", "optimizer_chain",
           "optimizer_tensors", "unwrap_optimizer", "keeps_fp32_masters", "model_prefixes", "note_script_names",
           "note_part_name", "script_bindings", "user_name", "module_label", "optimizer_slots"]

# Modules torch puts *inside* a model, between a module and its children: an FSDP1 unit (``FullyShardedDataParallel``
# keeps the wrapped module in ``_fsdp_wrapped_module``), activation checkpointing's ``CheckpointWrapper`` and
# ``torch.compile`` of a submodule (``_orig_mod``). Names leave them out, as the state-dict keys of the first two do.
_INNER_WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def user_name(name: str) -> str:
    """Return a module or parameter name from ``named_modules()`` as the user's code spells it: without the
    attributes of wrappers torch put inside the model (an empty name stays empty: the root).

    >>> user_name("_fsdp_wrapped_module.decoder.block.0._fsdp_wrapped_module._flat_param")
    'decoder.block.0._flat_param'
    """
    if "_" not in name:
        return name
    return ".".join(part for part in name.split(".") if part not in _INNER_WRAPPERS)


def module_label(name: str, prefix: str = "") -> str:
    """Return how the findings name module ``name`` (from ``named_modules()``) of a model whose names start with
    ``prefix`` (`model_prefixes`): as the user's code spells it (`user_name`); its root is the model's own name, or
    ``(root)`` when the run has one model.

    >>> module_label("_fsdp_wrapped_module.block.0"), module_label("", "netD."), module_label("")
    ('block.0', 'netD', '(root)')
    """
    name = user_name(name)
    return f"{prefix}{name}" if name else prefix.rstrip(".") or "(root)"


@dataclass(frozen=True)
class ParamInfo:
    """A parameter with its qualified name and the module that owns it."""

    name: str
    module: str
    param: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)

    def describe(self) -> str:
        """Return ``name (dtype, shape)`` as shown in findings."""
        return f"{self.name} ({dtype_name(self.dtype)}, {list(self.shape)})"


@dataclass
class TrainingSetup:
    """The real objects of one training run.

    Args:
        models: the modules being trained (a single module is accepted).
        optimizers: the optimizers stepping them (a single optimizer is accepted).
        scaler: the ``torch.amp.GradScaler`` (or subclass), if any.
        autocast_dtype: the dtype of the forward pass's ``torch.autocast``, if known.
        accelerator: an ``accelerate.Accelerator``, if any.
        facts: what process-wide observers saw (``ampdoctor.core.facts.ProcessFacts``), under ``ampdoctor run``.
        engines: engine objects that own mixed precision themselves (a DeepSpeed ZeRO optimizer, a Megatron-LM
            ``MixedPrecisionOptimizer``, an apex ``FP16_Optimizer``), when they were handed over explicitly.

    >>> s = TrainingSetup(nn.Linear(2, 2))
    >>> [p.name for p in s.params]
    ['weight', 'bias']
    """

    models: Any = ()
    optimizers: Any = ()
    scaler: Any = None
    autocast_dtype: torch.dtype | None = None
    accelerator: Any = None
    facts: Any = None
    engines: Any = ()
    found_engines: Any = field(default=None, init=False, repr=False, compare=False)   # set by the pre-flight rules
    params: list[ParamInfo] = field(init=False)
    prefixes: list[str] = field(init=False, repr=False)   # of each model's names (``model_prefixes``), read once
    _by_id: dict[int, ParamInfo] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.models = _as_list(self.models, nn.Module, "model", "an nn.Module")
        self.optimizers = _as_list(self.optimizers, torch.optim.Optimizer, "optimizer", "a torch.optim.Optimizer")
        self.params = []
        self._by_id = {}
        self.prefixes = model_prefixes(self.models)   # now: the script's module may be gone when a crash is named
        for model, prefix in zip(self.models, self.prefixes):
            for module_name, module in model.named_modules(remove_duplicate=True):
                label, module_name = module_label(module_name, prefix), user_name(module_name)
                for pname, p in module.named_parameters(recurse=False):
                    if id(p) in self._by_id:  # tied weights: first name wins, like named_parameters()
                        continue
                    full = f"{prefix}{module_name}.{pname}" if module_name else f"{prefix}{pname}"
                    info = ParamInfo(full, label, p)
                    self.params.append(info)
                    self._by_id[id(p)] = info

    def info(self, tensor: torch.Tensor) -> ParamInfo | None:
        """Return the model's name for ``tensor``, or None when no model owns it."""
        return self._by_id.get(id(tensor))

    def name_of(self, tensor: torch.Tensor, fallback: str = "<tensor not in any model>") -> str:
        info = self.info(tensor)
        return info.name if info else fallback

    def trainable(self) -> list[ParamInfo]:
        """Return the parameters with ``requires_grad=True``."""
        return [p for p in self.params if p.param.requires_grad]

    def optimizer_params(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield ``(optimizer_index, group_index, tensor)`` for every tensor in every optimizer."""
        for oi, opt in enumerate(self.optimizers):
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    yield oi, gi, p

    @property
    def scaler_enabled(self) -> bool:
        is_enabled = getattr(self.scaler, "is_enabled", None)   # GradScaler's public accessor
        return callable(is_enabled) and bool(is_enabled())


def optimizer_slots(optimizer: Any) -> dict[int, str]:
    """Map the id of each tensor ``optimizer`` holds to where it holds it, ``param_groups[g]['params'][i]``: the name
    of a tensor no model owns (a logit scale kept outside the model), as the user reaches it.

    >>> scale = torch.zeros(())
    >>> slots = optimizer_slots(torch.optim.SGD([{"params": [torch.zeros(1)]}, {"params": [scale]}], lr=0.1))
    >>> slots[id(scale)]
    "param_groups[1]['params'][0]"
    """
    return {id(p): f"param_groups[{gi}]['params'][{pi}]"
            for gi, group in enumerate(getattr(optimizer, "param_groups", ())) for pi, p in enumerate(group["params"])}


_SCRIPT_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> the script's name for it
_MAX_ENTRIES = 64   # entries of one list, tuple or dict looked at for models


def model_prefixes(models: list[nn.Module]) -> list[str]:
    """Return what each model's parameter and module names start with: nothing for one model; with several, the
    name the script gave it (``text_encoder.``, ``models[1].``, ``nets['D'].``: see `script_bindings`) at module
    level or, noted earlier (`note_script_names`), in a function's frame, else its class (``CLIPTextModel.``),
    numbered when two share one (``Linear[1].``).

    >>> a, b = nn.Linear(2, 2), nn.Conv1d(1, 1, 1)
    >>> model_prefixes([a]), model_prefixes([a, b]), model_prefixes([a, nn.Linear(2, 2)])
    ([''], ['Linear.', 'Conv1d.'], ['Linear[0].', 'Linear[1].'])
    """
    if len(models) < 2:
        return [""] * len(models)
    bound = script_bindings(getattr(sys.modules.get("__main__"), "__dict__", {}))
    for m in models:   # kept: a crash is named after the script's module is gone, and must name things the same
        if id(m) in bound:
            _SCRIPT_NAMES[m] = bound[id(m)]
    names = [_SCRIPT_NAMES.get(m, type(m).__name__) for m in models]
    return [f"{n}[{names[:i].count(n)}]." if names.count(n) > 1 else f"{n}." for i, n in enumerate(names)]


def script_bindings(namespace: Mapping[str, Any],
                    unwrap: Callable[[nn.Module], nn.Module] | None = None) -> dict[int, str]:
    """Map the id of each module in ``namespace`` (a script's globals, a frame's locals) to the first name that binds
    it there, in the namespace's order: a variable, or an entry of a list, tuple or dict one holds, as the user types
    it. Names starting with ``_``, ``self`` and namespaces held in it (runpy's ``run_globals``) are left out. With
    ``unwrap``, the module a wrapper delegates to (``G = DDP(G)``) has the wrapper's name too.

    >>> unet, encoder = nn.Linear(2, 2), nn.Linear(2, 2)
    >>> names = script_bindings({"unet": unet, "nets": {"text": encoder}, "parts": [encoder, unet]})
    >>> names[id(unet)], names[id(encoder)]
    ('unet', "nets['text']")
    """
    names: dict[int, str] = {}
    for key, value in list(namespace.items()):
        if not isinstance(key, str) or key.startswith("_") or key == "self":
            continue
        for name, item in _entries(key, value):
            if isinstance(item, nn.Module):
                names.setdefault(id(item), name)
                if unwrap is not None:
                    names.setdefault(id(unwrap(item)), name)
    return names


def _entries(key: str, value: Any) -> list[tuple[str, Any]]:
    """Return ``(name, item)`` for each entry of ``value`` bound to ``key``, a list, tuple or dict; else ``value``."""
    if isinstance(value, (list, tuple)):
        return [(f"{key}[{i}]", item) for i, item in enumerate(value[:_MAX_ENTRIES])]
    if isinstance(value, dict):
        if "__name__" in value:   # a namespace held in a namespace (runpy's run_globals): not the script's name
            return []
        return [(f"{key}[{k!r}]", item) for k, item in itertools.islice(value.items(), _MAX_ENTRIES)
                if isinstance(k, (str, int)) and not isinstance(k, bool)]
    return [(key, value)]


def note_part_name(part: nn.Module, namespaces: Iterable[Mapping[str, Any]]) -> None:
    """Remember the name the first of ``namespaces`` that binds it gives ``part`` (a model the script runs with
    nothing to train): its own (``teacher``), or its path in a module bound there (``vae.encoder``, which
    ``vae.encode()`` calls). Kept once given; `model_prefixes` names it so.

    >>> vae = nn.Sequential(nn.Linear(2, 2))
    >>> note_part_name(vae[0], [{"vae": vae}]); model_prefixes([nn.Linear(2, 2), vae[0]])[1]
    'vae.0.'
    """
    if part in _SCRIPT_NAMES:
        return
    for namespace in namespaces:
        direct = script_bindings(namespace).get(id(part))
        if direct is not None:
            _SCRIPT_NAMES[part] = direct
            return
        for key, value in list(namespace.items()):
            if not isinstance(key, str) or key.startswith("_") or key == "self":
                continue
            for name, item in _entries(key, value):
                path = next((p for p, sub in item.named_modules() if sub is part), None) \
                    if isinstance(item, nn.Module) else None
                if path:
                    _SCRIPT_NAMES[part] = f"{name}.{user_name(path)}"
                    return


def note_script_names(models: list[nn.Module], namespaces: Iterable[Mapping[str, Any]],
                      unwrap: Callable[[nn.Module], nn.Module] | None = None) -> None:
    """Remember, for each of several ``models`` without a name from the script yet, the first name ``namespaces`` give
    it (the locals of the user's frames, outermost first; see `script_bindings` for ``unwrap``): for models local to
    a function (``def main(): unet = ...``), or named in a crash's frames after the script's module is gone. A model
    keeps its name once given. ``namespaces`` is read only when there is a model to name."""
    todo = [m for m in models if m not in _SCRIPT_NAMES] if len(models) > 1 else []
    for namespace in namespaces if todo else ():
        bound = script_bindings(namespace, unwrap)
        taken = {_SCRIPT_NAMES.get(m) for m in models}   # one name, one model: `model` in two frames names the first
        for m in todo:
            name = bound.get(id(m))
            if name is not None and name not in taken:
                _SCRIPT_NAMES[m] = name
                taken.add(name)
        todo = [m for m in todo if m not in _SCRIPT_NAMES]
        if not todo:
            return


def _as_list(value: Any, kind: type, what: str, expected: str) -> list:
    if value is None:
        return []
    items: Iterable = [value] if isinstance(value, kind) else value
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"{what} must be {expected} or a list of them, "
                        f"got {type(value).__name__}: {value!r:.80}") from None
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(f"{what} must be {expected}, got {type(item).__name__}: {item!r:.80}")
    return items


def group_by_module(params: Iterable[ParamInfo]) -> dict[str, list[ParamInfo]]:
    """Return the parameters grouped by owning module, in model order."""
    groups: dict[str, list[ParamInfo]] = {}
    for p in params:
        groups.setdefault(p.module, []).append(p)
    return groups


_WRAPPED = ("optimizer", "_optimizer")  # accelerate/Fabric/MasterWeights keep `.optimizer`, Lightning `._optimizer`


def optimizer_chain(optimizer: Any, limit: int = 8) -> list[Any]:
    """Return ``[optimizer, the optimizer it wraps, ...]`` down to the one torch optimizer that does the update.

    Wrappers that only delegate (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``,
    Fabric's ``_FabricOptimizer``, ``ampdoctor.MasterWeights``) keep the inner optimizer in ``.optimizer`` or
    ``._optimizer``. A wrapper and its inner optimizer are one optimizer to diagnose. An engine's optimizer that is
    no torch optimizer but holds one (DeepSpeed's ``DeepSpeedZeroOptimizer``) is followed through too.

    >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    >>> optimizer_chain(opt) == [opt]
    True
    """
    chain = [optimizer]
    while len(chain) <= limit:
        inner = _wrapped(chain[-1])
        if inner is None:   # an engine's optimizer in between (accelerate's DeepSpeedOptimizerWrapper holds a
            # DeepSpeedZeroOptimizer, which is no torch optimizer, and that one holds the torch optimizer)
            inner = next((o for o in (getattr(chain[-1], a, None) for a in _WRAPPED)
                          if o is not None and not isinstance(o, torch.Tensor) and _wrapped(o) is not None), None)
        if inner is None or any(inner is o for o in chain):
            break
        chain.append(inner)
    return chain


def _wrapped(obj: Any) -> Any:
    """Return the torch optimizer ``obj`` keeps in one of ``_WRAPPED``, None if none."""
    return next((getattr(obj, a, None) for a in _WRAPPED if isinstance(getattr(obj, a, None), torch.optim.Optimizer)),
                None)


def unwrap_optimizer(optimizer: Any) -> Any:
    """Return the innermost torch optimizer behind any delegating wrappers (see `optimizer_chain`)."""
    return optimizer_chain(optimizer)[-1]


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Return every tensor in ``optimizer.param_groups``, in ``state_dict()`` numbering order.

    >>> len(optimizer_tensors(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)))
    2
    """
    return [p for group in optimizer.param_groups for p in group["params"]]


def owns_any(optimizer: Any, model: nn.Module) -> bool:
    """Return whether ``optimizer`` trains any parameter of ``model``.

    >>> m, other = nn.Linear(2, 2), nn.Linear(2, 2)
    >>> owns_any(torch.optim.SGD(m.parameters(), lr=0.1), m), owns_any(torch.optim.SGD(other.parameters()), m)
    (True, False)
    """
    ids = {id(p) for p in model.parameters()}
    return any(id(p) in ids for p in optimizer_tensors(optimizer))


def keeps_fp32_masters(optimizer: Any) -> bool:
    """Return whether ``optimizer``, or one it wraps, is an ``ampdoctor.MasterWeights`` (fp32 masters of half params).

    Recognised by its class marker ``keeps_fp32_masters`` or, for a copy or fork of it, by the class name, so that
    nothing has to import the repairs.

    >>> keeps_fp32_masters(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    False
    """
    return any(getattr(type(o), "keeps_fp32_masters", False)
               or any(c.__name__ == "MasterWeights" for c in type(o).__mro__) for o in optimizer_chain(optimizer))
