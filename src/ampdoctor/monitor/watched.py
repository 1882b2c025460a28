"""What a watch watches: the optimizer behind its wrappers, and the parameters by the names users know.

Wrapped optimizers. ``optimizer`` may be a wrapper that delegates to a torch optimizer (accelerate's
``AcceleratedOptimizer``, ``ampdoctor.MasterWeights``, both stacked; see ``optimizer_chain``). The step hooks go on
the innermost torch optimizer: its ``step()`` runs whichever wrapper the loop steps, while a wrapper may have no
hook tables of its own. ``scaler.step`` given any optimizer of the chain (or any wrapper of the innermost one) is
the watch's, and the scaler's stage is read for the object it was given. The gradients are the parameters'
``.grad`` at that point: what the innermost optimizer will apply (for ``MasterWeights``, the fp32 gradients of the
masters). Without a scaler given, the one a wrapper steps through is the watch's: accelerate's
``AcceleratedOptimizer`` keeps ``accelerator.scaler`` in ``.scaler`` and runs ``scaler.step(optimizer)`` and
``scaler.update()`` in its ``step()``; watching only the inner optimizer would miss every skipped step (it is never
called on one).

Engines. DeepSpeed's torch optimizer steps fp32 flat copies, not the model's parameters: ``EngineCopies`` names them
where the engine keeps them and merges ZeRO-1/2 partitions over the data-parallel ranks.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

from ampdoctor._compat.engines import engine_flat_copies, engine_stepper, loaded_engine_packages
from ampdoctor._torch.scaler import is_enabled
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.names import Names
from ampdoctor.core.training import TrainingSetup, optimizer_chain, unwrap_optimizer
from ampdoctor.core.words import counted

__all__ = ["watched_chain", "refuse_meta", "name_params", "other_models", "param_owners", "steps_through",
           "scaler_of", "EngineCopies"]


def watched_chain(model: Any, optimizer: Any) -> list[Any]:
    """Return ``optimizer_chain(optimizer)``, ending at the torch optimizer; raise a TypeError for a wrong argument.

    >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    >>> watched_chain(nn.Linear(2, 2), opt) == [opt]
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}: {model!r:.80}")
    chain = optimizer_chain(optimizer)
    inner = chain[-1]  # the torch optimizer that applies the update; its step hooks fire
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(inner).__name__}: {inner!r:.80}")
    return chain


def scaler_of(chain: Sequence[Any], scaler: Any = None) -> Any:
    """Return the enabled GradScaler the watch follows: ``scaler`` if given, else the first a wrapper in ``chain``
    holds in ``.scaler`` (accelerate's ``AcceleratedOptimizer``); None when that one is missing or disabled.

    >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    >>> scaler_of([opt]) is None, scaler_of([opt], torch.amp.GradScaler("cpu", enabled=False)) is None
    (True, True)
    """
    if scaler is None:
        scaler = next((o.scaler for o in chain if getattr(o, "scaler", None) is not None), None)
    return scaler if scaler is not None and is_enabled(scaler) else None


def steps_through(optimizer: Any, chain: Sequence[Any]) -> bool:
    """Return whether stepping ``optimizer`` steps ``chain[-1]``: it is in the chain, or it wraps ``chain[-1]``."""
    return bool(chain) and (any(optimizer is o for o in chain) or unwrap_optimizer(optimizer) is chain[-1])


def refuse_meta(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise a ValueError up front when the model or the optimizer holds parameters on the meta device."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    in_opt = sum(1 for g in optimizer.param_groups for p in g["params"] if isinstance(p, torch.Tensor) and p.is_meta)
    if meta or in_opt:
        where = f"{counted(len(meta), 'parameter')} of the model (first: {meta[0]!r})" if meta else \
            f"{counted(in_opt, 'parameter')} of the optimizer"
        raise ValueError(f"watch() got {where} on the meta device: meta tensors hold no values, so there are no "
                         f"gradients, loss scales or activations to watch. Materialise the model first "
                         f"(model.to_empty(device=...) and load its weights, or build it on a real device), "
                         f"create the optimizer for those parameters, then call watch()")


class ParamNames(NamedTuple):
    """The watched tensors' names, owning modules and dtypes, and the prefix of the watched model's names."""

    names: list[str]
    modules: list[str]
    dtypes: list[str]
    prefix: str


def name_params(model: nn.Module, params: Sequence[torch.Tensor], others: Sequence[nn.Module] = (),
                optimizer: Any = None, names: Names | None = None) -> ParamNames:
    """Return the names, owning modules and dtypes of ``params``, as the findings name them (``names``: the run's
    ``core.names.Names``): with ``others`` (a text encoder the same optimizer trains) each model's names have its
    prefix (``text_encoder.``, ``unet.``: see ``Names.prefixes``), returned for ``model`` too; a tensor no model owns
    is named where ``optimizer`` holds it (``param_groups[0]['params'][1]``, as the pre-flight and the explanations
    name it), in ``(not in model)``.

    >>> model, scale = nn.Linear(2, 2), torch.zeros(1)
    >>> name_params(model, [model.weight, scale], optimizer=torch.optim.SGD([model.weight, scale], lr=0.1))[:3]
    (['weight', "param_groups[0]['params'][1]"], ['(root)', '(not in model)'], ['float32', 'float32'])
    >>> name_params(model, [], others=[nn.Conv1d(1, 1, 1), model]).prefix
    'Linear.'
    """
    models = _run_models(model, others)
    setup = TrainingSetup(models, [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else (),
                          names=names or Names())   # one model: no prefix
    infos = [setup.info(p) for p in params]
    named = [setup.name_of(p, f"params[{k}]") for k, p in enumerate(params)]
    modules = [i.module if i else "(not in model)" for i in infos]
    prefix = setup.prefixes[next(k for k, m in enumerate(models) if m is model)]
    return ParamNames(named, modules, [dtype_name(p) for p in params], prefix)


def _run_models(model: nn.Module, others: Sequence[nn.Module]) -> list[nn.Module]:
    """Return the run's models in the order of ``others`` (the run's), as the findings number two models of one
    class (``Linear[1].``), with ``model`` first when ``others`` leaves it out."""
    return list(others) if any(m is model for m in others) else [model, *others]


def other_models(model: nn.Module, others: Sequence[nn.Module], frozen: Sequence[nn.Module] = (),
                 names: Names | None = None) -> list[tuple[nn.Module, str]]:
    """Return the run's models other than ``model``, then the ``frozen`` ones (a teacher, a VAE: models that ran a
    forward with nothing to train), each with its prefix as ``name_params`` names the run's, leaving out one that
    shares a module with ``model`` or with a model listed before it (one inside the other).

    >>> a, b, teacher = nn.Linear(2, 2), nn.Conv1d(1, 1, 1), nn.Linear(2, 2)
    >>> [(type(m).__name__, p) for m, p in other_models(a, [a, b, nn.Sequential(a)], [teacher, b])]
    [('Conv1d', 'Conv1d.'), ('Linear', 'Linear[1].')]
    """
    models, names = _run_models(model, others), names or Names()
    prefixes = names.prefixes(models)
    if frozen:   # numbered after the run's models, whose names stay those of the gradient table
        prefixes += names.prefixes([*models, *frozen])[len(models):]
    taken = {id(m) for m in model.modules()}
    out = []
    for m, prefix in zip([*models, *frozen], prefixes):
        own = [id(x) for x in m.modules()]
        if m is not model and not any(x in taken for x in own):
            out.append((m, prefix))
        taken.update(own)
    return out


def param_owners(models: Sequence[nn.Module], params: Sequence[torch.Tensor]) -> list[int | None]:
    """Return, for each of ``params``, the index of the first of ``models`` that holds it, None for none.

    >>> a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    >>> param_owners([a, b], [b.weight, a.bias, torch.zeros(1)])
    [1, 0, None]
    """
    owner: dict[int, int] = {}
    for k, model in enumerate(models):
        for p in model.parameters():
            owner.setdefault(id(p), k)
    return [owner.get(id(p)) for p in params]


def closure_calls_back(args: tuple, kwargs: dict, after: Callable[[], Any]) -> tuple[tuple, dict] | None:
    """Return ``(args, kwargs)`` of ``optimizer.step`` with its closure wrapped to call ``after()`` once it returns.

    For an optimizer step pre-hook (which may return new arguments; torch gives it the optimizer as ``args[0]``):
    ``step(closure)`` computes the gradients inside the step, after the pre-hook. The wrapper returns the closure's
    own loss; nothing else changes. None when the step has no closure.

    >>> opt = torch.optim.LBFGS([torch.zeros(1, requires_grad=True)])
    >>> args, kwargs = closure_calls_back((opt, lambda: 1.0), {}, lambda: print("read"))
    >>> args[0] is opt, args[1]()
    read
    (True, 1.0)
    """
    first = 1 if args and isinstance(args[0], torch.optim.Optimizer) else 0   # step(closure): after the optimizer
    closure = kwargs.get("closure", args[first] if len(args) > first else None)
    if not callable(closure):
        return None

    def closure_then_read() -> Any:
        loss = closure()
        after()
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_read}
    return (*args[:first], closure_then_read, *args[first + 1:]), kwargs


_EMPTY_OPTIMIZER = "it held no tensors when the watch attached, so no gradient was read"
_ZERO3 = " (DeepSpeed ZeRO stage 3 puts its fp32 partitions into the optimizer's param groups only inside step())"


class EngineCopies:
    """The fp32 flat copies an engine's optimizer steps among the watched tensors (DeepSpeed's), named where the
    engine keeps them.

    On construction the names and modules of those tensors are replaced in place (``param_groups[0]['params'][0]``
    in ``(not in model)`` becomes ``DeepSpeedZeroOptimizer.single_partition_of_fp32_groups[0]`` in ``(DeepSpeed fp32
    copy)``).

    Attributes:
        layouts: ``{id(tensor): layout}`` of the partitions split over data-parallel ranks: sharded over that group,
            so their statistics are merged into the whole gradient's.
        stepper: the engine optimizer that steps the watched torch optimizer once per parameter group (DeepSpeed's
            ``DeepSpeedZeroOptimizer``), None without one: a training step ends when its ``step()`` returns.
        padding: per watched tensor, the zeros the engine appended to this rank's partition (left out).

    >>> names, modules = ["param_groups[0]['params'][0]"], ["(not in model)"]
    >>> EngineCopies([], [torch.zeros(2)], names, modules).padding, names
    ([0], ["param_groups[0]['params'][0]"])
    """

    def __init__(self, objects: Sequence[Any], params: Sequence[torch.Tensor], names: list[str],
                 modules: list[str], optimizer: Any = None) -> None:
        engines = loaded_engine_packages()
        self._copies = engine_flat_copies(objects) if engines else {}
        # the engine optimizer whose step() is one training step (it steps ``optimizer`` once per group)
        self.stepper = engine_stepper(objects, optimizer) if engines and optimizer is not None else None
        self.layouts: dict[int, Any] = {}
        self.padding = [0] * len(params)
        for k, p in enumerate(params):
            copy = self._copies.get(id(p))
            if copy is None:
                continue
            names[k], modules[k], self.padding[k] = copy.name, f"({copy.family} fp32 copy)", copy.padding
            if copy.group is not None:
                self.layouts[id(p)] = ("sharded", (copy.group,))

    def why_empty(self) -> str:
        """Say why the watched optimizer held no tensors, for the summary."""
        zero3 = any(".fp32_partitioned_groups_flat[" in c.name for c in self._copies.values())
        return _EMPTY_OPTIMIZER + (_ZERO3 if zero3 else "")
