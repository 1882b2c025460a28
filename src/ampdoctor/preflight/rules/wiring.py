"""Pre-flight rules AMP301–AMP302: whether the optimizers step the very tensors the models train.

Both rules match tensors by identity, in one pass each: the setup's ``id -> parameter`` map for AMP301, a set of the
optimizers' tensor ids for AMP302. Wrappers that delegate ``param_groups`` (accelerate's ``AcceleratedOptimizer``,
``ampdoctor.MasterWeights``) hold the model's own parameters, so they need no special case.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding
from ampdoctor.preflight.rules import check
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.preflight.rules.params import findings_by_module
from ampdoctor.core.training import ParamInfo, TrainingSetup

MAX_STRAYS = 5  # stray tensors described one by one per param group


def _hint(tensor: torch.Tensor, twin: ParamInfo | None) -> str:
    """Say what the model has in the stray tensor's place."""
    if twin is None:
        return "no model parameter has this shape (another model's optimizer?)"
    other = twin.param
    differs = []
    if other.dtype != tensor.dtype:
        differs.append(f"dtype {dtype_name(other.dtype)}")
    if other.device != tensor.device:
        differs.append(f"device {other.device}")
    but = f", but {' and '.join(differs)}" if differs else ""
    return f"the model has {twin.name} with the same shape{but}"


@check("AMP301")
def optimizer_tensors_not_in_model(setup: TrainingSetup) -> Iterator[Finding]:
    """Name optimizer tensors that are parameters of no model in the setup.

    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # another model's tensors
    >>> [f.where for f in optimizer_tensors_not_in_model(TrainingSetup(model, opt))]
    ['optimizer[0] group 0']
    """
    if not setup.models:
        return
    rule = get_rule("AMP301")
    same_shape: dict[tuple[int, ...], ParamInfo] | None = None  # built on the first stray only
    for oi, opt in enumerate(setup.optimizers):
        for gi, group in enumerate(opt.param_groups):
            tensors = group["params"]
            strays = [(i, t) for i, t in enumerate(tensors) if setup.info(t) is None]
            if not strays:
                continue
            if same_shape is None:
                same_shape = _twins_by_shape(setup)
            described = [f"params[{i}] ({dtype_name(t.dtype)}, {list(t.shape)}, {t.device}): "
                         f"{_hint(t, same_shape.get(tuple(t.shape)))}" for i, t in strays[:MAX_STRAYS]]
            more = f"; and {len(strays) - MAX_STRAYS} more" if len(strays) > MAX_STRAYS else ""
            yield Finding(
                "AMP301", rule.severity, f"optimizer[{oi}] group {gi}",
                f"{len(strays)} of {len(tensors)} tensors in this group are not parameters of the model: "
                f"{'; '.join(described)}{more}. Was the optimizer built before .to()/.half()/wrapping or re-creating "
                "the model? It steps these stale tensors, and the model parameters they stand for are never updated.",
            )


def _twins_by_shape(setup: TrainingSetup) -> dict[tuple[int, ...], ParamInfo]:
    """Map each shape to a model parameter of that shape, preferring one that no optimizer holds."""
    in_optimizer = {id(t) for _, _, t in setup.optimizer_params()}
    twins: dict[tuple[int, ...], ParamInfo] = {}
    for p in setup.params:
        current = twins.get(p.shape)
        if current is None or (id(current.param) in in_optimizer and id(p.param) not in in_optimizer):
            twins[p.shape] = p
    return twins


@check("AMP302")
def params_missing_from_optimizer(setup: TrainingSetup) -> Iterator[Finding]:
    """Name trainable parameters that no optimizer steps.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    >>> [f.where for f in params_missing_from_optimizer(TrainingSetup(model, opt))]
    ['1']
    """
    if not setup.optimizers:
        return
    in_optimizer = {id(t) for opt in setup.optimizers for group in opt.param_groups for t in group["params"]}
    trainable = setup.trainable()
    missing = [p for p in trainable if id(p.param) not in in_optimizer]
    if not missing:
        return
    if len(missing) == len(trainable):
        summary = (f"None of the {len(trainable)} trainable parameters is in an optimizer: the optimizers were built "
                   "over other tensors (see AMP301) or another model.")
    else:
        summary = (f"{len(missing)} of {len(trainable)} trainable parameters are in no optimizer's param_groups; "
                   "they get gradients and memory but are never updated.")
    yield from findings_by_module("AMP302", missing, "trainable but in no optimizer", summary)

