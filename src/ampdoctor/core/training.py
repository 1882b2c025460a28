"""The training objects under examination, gathered once with the names users know them by."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from ampdoctor.core.dtypes import HALF, LOW_PRECISION, dtype_name
from ampdoctor.core.names import Names, module_label, user_name

__all__ = ["HALF", "LOW_PRECISION", "ParamInfo", "TrainingSetup", "group_by_module", "optimizer_chain",
           "optimizer_tensors", "unwrap_optimizer", "keeps_fp32_masters"]

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
        loss_scaler: a library's own loss scaler (fairseq's ``DynamicLossScaler``, DeepSpeed's, ...), if one is
            live: without an enabled GradScaler the watch reads its scale and skipped steps.
        names: how the run names things (``core.names.Names``): the run's one, so that every setup of a run names
            its models as the script does; a setup built alone gets its own.

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
    loss_scaler: Any = None
    names: Names = field(default_factory=Names, repr=False, compare=False)
    found_engines: Any = field(default=None, init=False, repr=False, compare=False)   # set by the pre-flight rules
    params: list[ParamInfo] = field(init=False)
    prefixes: list[str] = field(init=False, repr=False)   # of each model's names (``Names.prefixes``), read once
    _by_id: dict[int, ParamInfo] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.models = _as_list(self.models, nn.Module, "model", "an nn.Module")
        self.optimizers = _as_list(self.optimizers, torch.optim.Optimizer, "optimizer", "a torch.optim.Optimizer")
        self.params = []
        self._by_id = {}
        self.prefixes = self.names.prefixes(self.models)   # now: the script's module may be gone when a crash is named
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

    def name_of(self, tensor: torch.Tensor, fallback: str = "<tensor not in any model>", optimizer: Any = None) -> str:
        """Return the name of ``tensor``: its model's, else where ``optimizer`` (default: the first of the setup's
        optimizers that holds it) keeps it (``param_groups[1]['params'][0]``, ``core.names.Names.free_tensor``),
        else ``fallback``.

        >>> model, scale = nn.Linear(2, 2), torch.zeros(())
        >>> setup = TrainingSetup(model, torch.optim.SGD([*model.parameters(), scale], lr=0.1))
        >>> setup.name_of(model.bias), setup.name_of(scale), setup.name_of(torch.zeros(1))
        ('bias', "param_groups[0]['params'][2]", '<tensor not in any model>')
        """
        info = self.info(tensor)
        if info is not None:
            return info.name
        free = self.names.free_tensor(tensor, [optimizer] if optimizer is not None else self.optimizers)
        return free if free is not None else fallback

    def describe(self, tensor: torch.Tensor, optimizer: Any = None, fallback: str = "not in the model") -> str:
        """Return ``name (dtype, shape)`` of ``tensor`` as findings show it (see `name_of`)."""
        return f"{self.name_of(tensor, fallback, optimizer)} ({dtype_name(tensor.dtype)}, {list(tensor.shape)})"

    def optimizer_label(self, optimizer: Any) -> str:
        """Return ``optimizer[0] (AdamW)``, numbered as in ``optimizers`` (``core.names.Names.optimizer``)."""
        return self.names.optimizer(optimizer, self.optimizers)

    def with_scaler(self, scaler: Any) -> "TrainingSetup":
        """Return this setup, or a copy that includes ``scaler`` when it has none (checks may need it)."""
        return self if scaler is None or self.scaler is not None else replace(self, scaler=scaler)

    def renamed(self, namespaces: Iterable[Mapping[str, Any]]) -> "TrainingSetup":
        """Return this setup, or a copy named again when ``namespaces`` (the locals of a crash's frames, outermost
        first) give names to models it named by their class: a crash is explained after the script's module is
        gone (``core.names.Names.note_script_names``)."""
        self.names.note_script_names(self.models, namespaces)
        return self if self.names.prefixes(self.models) == self.prefixes else replace(self)

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
