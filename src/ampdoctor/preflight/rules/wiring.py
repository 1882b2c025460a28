"""Pre-flight rules AMP301–AMP302: whether the optimizers step the very tensors the models train.

Both rules match tensors by identity, in one pass each: the setup's ``id -> parameter`` map for AMP301, a set of the
optimizers' tensor ids for AMP302. Wrappers that delegate ``param_groups`` (accelerate's ``AcceleratedOptimizer``,
``ampdoctor.MasterWeights``) hold the model's own parameters, so they need no special case.

An optimizer tensor outside the model that has a ``.grad`` when the rules run (``ampdoctor run`` runs them at the
first optimizer step) is trained by the script's own wiring: a hand-written fp32 master copy of a half parameter
(fairseq's FP16Optimizer, Megatron's and apex's per-parameter or flat fp32 copies, a loop that copies the grads in
and the weights back), or a learnable tensor kept outside the module. A stale tensor never gets one. Such tensors
are no AMP301, and the model parameters they stand for (same shapes, or the same number of entries when flat) are
no AMP302. Before the first backward no tensor has a gradient: ``ampdoctor run`` checks the pre-flight's AMP301 and
AMP302 again at the first optimizer step (``confirm_wiring``), and keeps what still holds.

An optimizer tensor outside the model without a ``.grad`` is stale (AMP301) only when it stands for model parameters
(``stale_tensors``): its optimizer holds none of the model's parameters while some trainable parameter is in no
optimizer (or no optimizer holds any parameter of the model), or it has the shape of a trainable parameter that no
optimizer holds (or, flat, as many entries as one of them or all of them together). Any other one is free-standing,
trained next to the model's own parameters (CLIP's logit scale kept outside the model, a learned temperature or loss
weight, SAC's entropy coefficient in an optimizer of its own): no model parameter goes unstepped for want of it, and
it may get its first gradient after the first optimizer step (after a warm-up), or a crash may end the run before it.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ampdoctor.core.catalog import Rule
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.findings import Finding
from ampdoctor.core.report import Report
from ampdoctor.core.training import ParamInfo, TrainingSetup
from ampdoctor.preflight.rules import check, findings_by_module

MAX_STRAYS = 5  # stray tensors described one by one per param group
WIRING = ("AMP301", "AMP302")


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
def optimizer_tensors_not_in_model(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Name optimizer tensors that are parameters of no model in the setup.

    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # another model's tensors
    >>> [f.where for f in optimizer_tensors_not_in_model(TrainingSetup(model, opt))]
    ['optimizer[0] group 0']
    """
    stale = stale_tensors(setup)
    if not stale:
        return
    same_shape = _twins_by_shape(setup)
    for oi, opt in enumerate(setup.optimizers):
        for gi, group in enumerate(opt.param_groups):
            tensors = group["params"]
            strays = [(i, t) for i, t in enumerate(tensors) if id(t) in stale]
            if not strays:
                continue
            described = [f"params[{i}] ({dtype_name(t.dtype)}, {list(t.shape)}, {t.device}): "
                         f"{_hint(t, same_shape.get(tuple(t.shape)))}" for i, t in strays[:MAX_STRAYS]]
            more = f"; and {len(strays) - MAX_STRAYS} more" if len(strays) > MAX_STRAYS else ""
            yield rule.finding(
                f"optimizer[{oi}] group {gi}",
                f"{len(strays)} of {len(tensors)} tensors in this group are not parameters of the model: "
                f"{'; '.join(described)}{more}. Was the optimizer built before .to()/.half()/wrapping or re-creating "
                "the model? It steps these stale tensors, and the model parameters they stand for are never updated.",
            )


def stale_tensors(setup: TrainingSetup) -> set[int]:
    """Return the ids of the optimizer tensors that stand for model parameters without being them (see the module's
    docstring): no model owns them, they have no ``.grad``, and they are not free-standing.

    >>> model = torch.nn.Linear(2, 2)
    >>> scale = torch.nn.Parameter(torch.ones(()))   # a logit scale kept outside the model
    >>> stale_tensors(TrainingSetup(model, torch.optim.SGD([*model.parameters(), scale], lr=0.1)))
    set()
    >>> stale = torch.nn.Linear(2, 2)   # the model the optimizer was built over, since re-created
    >>> len(stale_tensors(TrainingSetup(model, torch.optim.SGD(stale.parameters(), lr=0.1))))
    2
    """
    if not setup.models:
        return set()
    held = [[t for group in opt.param_groups for t in group["params"]] for opt in setup.optimizers]
    in_optimizer = {id(t) for tensors in held for t in tensors}
    holds_model = [any(setup.info(t) is not None for t in tensors) for tensors in held]
    missing = [p for p in setup.trainable() if id(p.param) not in in_optimizer]
    shapes = {p.shape for p in missing}
    sizes = {p.param.numel() for p in missing} | {sum(p.param.numel() for p in missing)}
    stale = set()
    for tensors, own in zip(held, holds_model):
        # built over other tensors only: another model's, or an earlier one's that the model's own replaced
        whole = not own and (bool(missing) or not any(holds_model))
        for t in tensors:
            if setup.info(t) is None and t.grad is None and (
                    whole or tuple(t.shape) in shapes or (t.dim() == 1 and missing and t.numel() in sizes)):
                stale.add(id(t))
    return stale


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
def params_missing_from_optimizer(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Name trainable parameters that no optimizer steps.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    >>> [f.where for f in params_missing_from_optimizer(TrainingSetup(model, opt))]
    ['1']
    """
    if not setup.optimizers:
        return
    held = [t for opt in setup.optimizers for group in opt.param_groups for t in group["params"]]
    in_optimizer = {id(t) for t in held}
    trainable = setup.trainable()
    missing = [p for p in trainable if id(p.param) not in in_optimizer]
    missing = _not_stood_in(missing, [t for t in held if t.grad is not None and setup.info(t) is None])
    if not missing:
        return
    if len(missing) == len(trainable):
        # AMP301 names the optimizers' stale tensors when there are any: point to it only then
        if stale_tensors(setup):
            built = "over other tensors (see AMP301) or another model."
        elif held:
            built = ("over frozen parameters of the model (requires_grad=False) only: build them over the "
                     "parameters that train, e.g. [p for p in model.parameters() if p.requires_grad].")
        else:
            built = "over no tensor at all."
        summary = (f"None of the {len(trainable)} trainable parameters is in an optimizer: the optimizers were built "
                   f"{built}")
    else:
        summary = (f"{len(missing)} of {len(trainable)} trainable parameters are in no optimizer's param_groups; "
                   "they get gradients and memory but are never updated.")
    yield from findings_by_module(rule, missing, "trainable but in no optimizer", summary)



def _not_stood_in(missing: list[ParamInfo], copies: list[torch.Tensor]) -> list[ParamInfo]:
    """Return the ``missing`` parameters that no trained optimizer tensor outside the model stands for: one copy of
    the same shape each, or flat copies with as many entries in all."""
    if not copies:
        return missing
    if sum(t.numel() for t in copies) == sum(p.param.numel() for p in missing):
        return []
    shapes: dict[tuple[int, ...], int] = {}
    for t in copies:
        shapes[tuple(t.shape)] = shapes.get(tuple(t.shape), 0) + 1
    left = []
    for p in missing:
        if shapes.get(tuple(p.shape), 0):
            shapes[tuple(p.shape)] -= 1
        else:
            left.append(p)
    return left


def confirm_wiring(report: Report, setup: TrainingSetup) -> None:
    """Replace the AMP301/AMP302 findings of ``report`` (said before the first backward) with what the two rules
    find now, at an optimizer step: tensors that received gradients by the script's own wiring are no longer named."""
    now = [*optimizer_tensors_not_in_model(setup), *params_missing_from_optimizer(setup)]
    kept = {(f.code, f.where) for f in now}
    report.findings = [f for f in report.findings if f.code not in WIRING or (f.code, f.where) in kept]
