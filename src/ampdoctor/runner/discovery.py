"""Find what a process trains: its real optimizers, the models they train, its GradScalers (or a library's own loss
scaler: fairseq's, DeepSpeed's, ..., recognised by its class name and attributes, ``_compat.loss_scalers``).

torch offers no global hook for the construction of an optimizer or a module, so the live objects are read in one
garbage-collector scan when the Doctor first needs them (and again for an optimizer it has not seen before: a new
fold, a resume, a second stage). A model is what an optimizer trains: each trained parameter is mapped to the
module that owns it, then up to that module's outermost parent, whose names are the ones users know
(``net.2.weight``, ``encoder.layer.0...``), whether the training step called the whole model or its parts.
"""

from __future__ import annotations

import gc
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Container, Iterable, Sequence

import torch
from torch import nn

from ampdoctor._compat.engines import engine_family
from ampdoctor._compat.lightning import fabric_module_of, is_fabric_module
from ampdoctor._compat.loss_scalers import SCALER_NAMES, loss_scaler_shape
from ampdoctor._torch.modules import delegate_of, is_delegating_wrapper, own_children, own_parameters
from ampdoctor.core.training import optimizer_chain, optimizer_tensors


@dataclass
class LiveObjects:
    """One scan's worth of live training objects."""

    optimizers: list[Any] = field(default_factory=list)   # the real ones: wrappers resolved, each once
    modules: list[nn.Module] = field(default_factory=list)
    scalers: list[Any] = field(default_factory=list)
    loss_scalers: list[Any] = field(default_factory=list)   # the libraries' own (fairseq's, DeepSpeed's, ...)


def scaler_classes() -> tuple[type, ...]:
    """Return the GradScaler classes loaded in this process (ShardedGradScaler only if FSDP was imported)."""
    classes: list[type] = [torch.amp.GradScaler]
    sharded = sys.modules.get("torch.distributed.fsdp.sharded_grad_scaler")
    if sharded is not None:
        classes.append(sharded.ShardedGradScaler)
    return tuple(classes)


def instances(*classes: type, names: Container[str] = ()) -> list[Any]:
    """Return the live instances of ``classes`` after a collection (so an earlier run's garbage is not seen), and
    the objects whose class has one of ``names`` (a library's class, found without importing the library)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on deprecated proxies (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, classes) or type(o).__name__ in names]


def scan(leave_out: Container[Any] = ()) -> LiveObjects:
    """Return the live optimizers (deduplicated through their wrappers), modules, GradScalers and libraries' own loss
    scalers.

    Args:
        leave_out: real optimizers and GradScalers of an ended stage that something else still holds (IPython keeps
            a crashed cell's traceback, ``sys.last_traceback``, and its frames keep the cell's optimizer and scaler):
            they are not what the process trains now.
    """
    scalers = scaler_classes()
    found = instances(torch.optim.Optimizer, nn.Module, *scalers, names=SCALER_NAMES)
    return LiveObjects(live_optimizers((o for o in found if isinstance(o, torch.optim.Optimizer)), leave_out),
                       [o for o in found if isinstance(o, nn.Module)],
                       [o for o in found if isinstance(o, scalers) and o not in leave_out],
                       [o for o in found if loss_scaler_shape(o) is not None and o not in leave_out])


def live_optimizers(optimizers: Iterable[Any], leave_out: Container[Any] = ()) -> list[Any]:
    """Return `real_optimizers` of ``optimizers``, less those in ``leave_out`` (see `scan`)."""
    return [o for o in real_optimizers(optimizers) if o not in leave_out]


def real_optimizers(optimizers: Iterable[Any]) -> list[Any]:
    """Return one entry per real optimizer: the innermost of each wrapper chain, in first-seen order.

    Lightning's ``LightningOptimizer``, accelerate's ``AcceleratedOptimizer``, Fabric's wrapper and
    ``ampdoctor.MasterWeights`` delegate to one torch optimizer; diagnosing both would report everything twice.
    A ``ZeroRedundancyOptimizer``'s own per-rank optimizer (``.optim``) is left out: it is ZeRO's internal part.
    """
    optimizers = list(optimizers)
    chains = [optimizer_chain(o) for o in optimizers]
    wrapped = {id(inner) for chain in chains for inner in chain[1:]}
    internal = {id(o) for o in internal_optimizers(optimizers)}
    real: dict[int, Any] = {}
    for chain in chains:
        inner = chain[-1]
        if (id(chain[0]) in wrapped and chain[0] is not inner) or id(inner) in internal:
            continue  # a wrapper inside another wrapper (its chain is reached from the outer one), or ZeRO's part
        real.setdefault(id(inner), inner)
    return list(real.values())


def internal_optimizers(optimizers: Iterable[Any]) -> list[Any]:
    """Return the optimizers that are an internal part of others: a ``ZeroRedundancyOptimizer`` holds every
    parameter and steps its own per-rank optimizer over this rank's partition (``.optim``), not a second optimizer
    of the script."""
    return [o.optim for o in optimizers if type(o).__name__ == "ZeroRedundancyOptimizer"
            and isinstance(getattr(o, "optim", None), torch.optim.Optimizer)]


def _delegating(module: nn.Module) -> bool:
    """Whether ``module`` only delegates to the user's module: names are the wrapped module's (``encoder.0.weight``,
    not ``module.encoder.0.weight``), as the user's own code and checkpoints spell them."""
    return is_delegating_wrapper(module) or is_fabric_module(module)


def unwrap_module(module: nn.Module) -> nn.Module:
    """Return the user's module inside delegating wrappers (DDP, DataParallel, Fabric, ``torch.compile``).

    >>> unwrap_module(torch.nn.parallel.DataParallel(nn.Linear(2, 2))).__class__.__name__
    'Linear'
    """
    for _ in range(8):
        inner = delegate_of(module) or fabric_module_of(module)
        if inner is None:
            break
        module = inner
    return module


def outermost(module: nn.Module, parents: dict[int, nn.Module]) -> nn.Module:
    """Return the outermost module that contains ``module`` (itself when nothing does), below any wrapper."""
    seen = {id(module)}
    while id(module) in parents and id(parents[id(module)]) not in seen:
        parent = parents[id(module)]
        if _delegating(parent):
            break
        module = parent
        seen.add(id(module))
    return unwrap_module(module)


def trained_models(seen: Iterable[nn.Module], optimizers: Iterable[Any],
                   modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Return the models the optimizers train, each the outermost owner of trained parameters.

    Args:
        seen: modules seen running a forward with gradients (whole models or the parts a training step calls).
        optimizers: the real optimizers.
        modules: every live module (from `scan`), to find parents and owners.

    A module seen in a forward whose parameters no optimizer trains (an EMA copy, a frozen teacher) is left out
    when there are optimizers, unless an optimizer holds tensors that no live module owns (built over a model
    object that was then replaced) and the seen module has trainable parameters; without optimizers the seen
    modules are the models. An engine module (DeepSpeed's ``DeepSpeedEngine``, Megatron-LM's
    ``DistributedDataParallel``) is kept: its optimizer steps fp32 flat copies, not the module's parameters, and
    the pre-flight rules need it to say that the engine owns the precision.
    """
    parents, owner = _parents_and_owners(modules)
    trained = {id(p) for o in optimizers for p in optimizer_tensors(o)}
    roots: dict[int, nn.Module] = {}
    for m in seen:
        root = outermost(m, parents)
        if not trained or engine_family(root) or any(id(p) in trained for p in root.parameters()):
            roots.setdefault(id(root), root)
    orphans = _add_owners(roots, optimizers, owner, parents)
    if orphans:
        # The optimizer was built over a model object that was since replaced (re-created, reloaded): the module
        # that trains now shares no tensor with it. It is the model all the same, so the rules can say that its
        # parameters are in no optimizer and the optimizer's tensors in no model (AMP301, AMP302).
        for m in seen:
            root = outermost(m, parents)
            if id(root) not in roots and any(p.requires_grad for p in root.parameters()):
                roots.setdefault(id(root), root)
    return list(roots.values())


def unseen_tensors(optimizer: Any, seen: Sequence[nn.Module],
                   models: Sequence[nn.Module]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Return the trainable tensors of ``optimizer`` that no model seen running a forward pass holds: those of
    ``models`` (the outermost owners, `trained_models`) none of whose modules was ``seen``, and those no model holds,
    when none was seen at all.

    Every tensor an optimizer trains should belong to a model seen running forward: that is what the watch follows.
    A model counts as seen when any part of it ran (a step that calls ``self.encoder(...)`` and uses the model's own
    ``logit_scale`` directly); a tensor no module holds, trained beside a model that ran (a learnable temperature,
    an engine's fp32 copy), is used by that forward pass.

    >>> model, free = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Parameter(torch.zeros(2))
    >>> opt = torch.optim.SGD([*model.parameters(), free], lr=0.1)
    >>> [len(t) for t in unseen_tensors(opt, [], [model])], [len(t) for t in unseen_tensors(opt, [model[0]], [model])]
    ([4, 1], [0, 0])
    """
    ran = {id(p) for m in seen for p in m.parameters()}
    covered, held = set(ran), set()
    for model in models:
        ids = {id(p) for p in model.parameters()}
        held |= ids
        if not ran.isdisjoint(ids):
            covered |= ids
    unseen = [p for p in optimizer_tensors(optimizer) if p.requires_grad and id(p) not in covered]
    return [p for p in unseen if id(p) in held], [p for p in unseen if not seen and id(p) not in held]


def _parents_and_owners(modules: Iterable[nn.Module]) -> tuple[dict[int, nn.Module], dict[int, nn.Module]]:
    """Return each module's parent and each parameter's owner, by id (the first one found)."""
    parents: dict[int, nn.Module] = {}
    owner: dict[int, nn.Module] = {}
    for m in modules:
        for child in own_children(m):
            parents.setdefault(id(child), m)
        for p in own_parameters(m):
            owner.setdefault(id(p), m)
    return parents, owner


def _add_owners(roots: dict[int, nn.Module], optimizers: Iterable[Any], owner: dict[int, nn.Module],
                parents: dict[int, nn.Module]) -> bool:
    """Add to ``roots`` the outermost owner of each optimizer tensor that no root holds yet; return whether some
    optimizer tensor has no live owner at all (the model it came from is gone)."""
    covered = {id(p) for r in roots.values() for p in r.parameters()}
    orphans = False
    for o in optimizers:
        for p in optimizer_tensors(o):
            if id(p) not in covered and id(p) in owner:
                root = outermost(owner[id(p)], parents)
                roots.setdefault(id(root), root)
                covered.update(id(q) for q in root.parameters())
            orphans = orphans or id(p) not in owner
    return orphans
