"""Name the culprits of a rule: the pre-flight check of the rule when one is registered, else the parameters of a
dtype or the tensors without a gradient. Shared by crash explanations and ``ScalerGuard``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace
from typing import Any

import torch

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.findings import Finding
from ampdoctor.core.isolation import call_safely
from ampdoctor.core.names import listing
from ampdoctor.core.training import ParamInfo, TrainingSetup, group_by_module
from ampdoctor.core.words import counted

_LOADED_CHECKS = False


def _from_check(code: str, setup: TrainingSetup, step: int | None = None) -> list[Finding]:
    """Run the pre-flight check of ``code``, if one is registered, to name the culprits."""
    global _LOADED_CHECKS
    from ampdoctor.preflight import rules as rules_pkg

    if not _LOADED_CHECKS:
        _LOADED_CHECKS = True
        for module in pkgutil.iter_modules(rules_pkg.__path__):   # another rule module's bug must not hide this
            call_safely(importlib.import_module, f"{rules_pkg.__name__}.{module.name}")
    check = rules_pkg.CHECKS.get(code)
    if check is None:
        return []
    # a broken check must not hide the explanation
    return call_safely(lambda: [replace(f, step=step) for f in check(setup) if f.code == code]) or []


def fp16_culprits(setup: TrainingSetup, optimizer: Any = None, raised_on: torch.Tensor | None = None,
                  step: int | None = None) -> list[Finding]:
    """Name the trainable float16 parameters behind 'Attempting to unscale FP16 gradients' (AMP101).

    The pre-flight check of AMP101 is used when it is registered; otherwise they are listed here.
    """
    return (_from_check("AMP101", setup, step)
            or half_param_findings(setup, torch.float16, "AMP101", optimizer, raised_on, step))


def half_param_findings(setup: TrainingSetup, dtype: torch.dtype, code: str, optimizer: Any = None,
                        raised_on: torch.Tensor | None = None, step: int | None = None) -> list[Finding]:
    """Name every trainable parameter of ``dtype``, one finding per module.

    Without a model in ``setup``, the optimizer's parameters are listed instead.
    """
    half = [p for p in setup.trainable() if p.dtype == dtype]
    findings = []
    culprit = setup.info(raised_on) if raised_on is not None else None
    for module, params in group_by_module(half).items():
        detail = f"trainable {dtype_name(dtype)} parameters: {listing([p.describe() for p in params])}"
        if culprit is not None and culprit in params:
            detail += f"; GradScaler raised on {culprit.name}"
        findings.append(get_rule(code).finding(module, detail, step))
    if not findings and optimizer is not None:
        loose = [p for g in optimizer.param_groups for p in g["params"]
                 if isinstance(p, torch.Tensor) and p.requires_grad and p.dtype == dtype]
        if loose:
            findings.append(get_rule(code).finding(setup.optimizer_label(optimizer),
                                    f"trainable {dtype_name(dtype)} tensors: "
                                    f"{listing([setup.describe(p, optimizer) for p in loose])}", step))
    return findings


def _rank() -> tuple[int, int] | None:
    """Return (rank, world size) in a process group of two or more ranks, else None."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.get_world_size()
    return (dist.get_rank(), world) if world > 1 else None


def no_grad_findings(optimizer: Any, setup: TrainingSetup, step: int | None = None) -> list[Finding]:
    """Say, for each tensor of ``optimizer`` without a ``.grad``, why it got none (AMP406, AMP301)."""
    label = setup.optimizer_label(optimizer)
    held = [p for group in optimizer.param_groups for p in group["params"] if isinstance(p, torch.Tensor)]
    rank = _rank()
    if not held:
        return [_empty_optimizer(label, rank, step)]
    frozen, unused, foreign, unsharded = _without_grad(optimizer, setup, label)
    trainable = sum(p.requires_grad for p in held)   # python bools: no device work
    findings = []
    if unsharded and rank is not None:
        findings.append(_no_local_shard(label, unsharded, rank, step))
    for module, params in group_by_module(frozen).items():
        why = f"{listing([p.name for p in params])}: frozen (requires_grad=False), so no gradient reaches {label}"
        if not trainable:
            why = (f"{label} holds {counted(len(held), 'parameter')}, none of which requires grad; {why}; make them "
                   "trainable (peft: PeftModel.from_pretrained(..., is_trainable=True)) or build the optimizer "
                   "over the trainable ones")
        findings.append(get_rule("AMP406").finding(module, why, step))
    for module, params in group_by_module(unused).items():
        why = ("requires_grad=True but .grad is None after backward: not used in the forward pass, or cut off by "
               "reentrant gradient checkpointing (use_reentrant=False)")
        if not setup.models:
            why += "; the model is unknown, so ampdoctor cannot tell whether these are its parameters"
        findings.append(get_rule("AMP406").finding(module, f"{listing([p.name for p in params])}: {why}", step))
    if foreign:
        findings += _foreign_tensors(label, foreign, setup, step)
    return findings


def _without_grad(optimizer: Any, setup: TrainingSetup,
                  label: str) -> tuple[list[ParamInfo], list[ParamInfo], list[str], list[str]]:
    """Sort the tensors of ``optimizer`` without a ``.grad``: frozen ones, trainable ones backward did not reach,
    tensors that are not the model's, and (under FSDP) parameters with no elements on this rank."""
    frozen: list[ParamInfo] = []
    unused: list[ParamInfo] = []
    foreign: list[str] = []
    unsharded: list[str] = []
    stale = _stale(setup)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, torch.Tensor) or p.grad is not None:
                continue
            if p.requires_grad and p.numel() == 0 and _rank() is not None:
                unsharded.append(setup.describe(p, optimizer))   # FSDP gave all its elements to other ranks
                continue
            info = setup.info(p)
            if info is None and p.requires_grad and setup.models and (stale is None or id(p) in stale):
                foreign.append(setup.describe(p, optimizer))
            elif info is None:
                frozen_or_unknown = ParamInfo(setup.describe(p, optimizer), label, p)
                (unused if p.requires_grad else frozen).append(frozen_or_unknown)
            else:
                (unused if p.requires_grad else frozen).append(info)
    return frozen, unused, foreign, unsharded


def _stale(setup: TrainingSetup) -> set[int] | None:
    """Return the ids of the optimizer tensors that stand for model parameters without being them (AMP301's
    ``stale_tensors``); None when that check cannot run. Any other tensor outside the model is free-standing (a
    learned temperature): without a gradient, the loss did not use it."""
    # a broken rule module must not hide the explanation
    return call_safely(lambda: importlib.import_module("ampdoctor.preflight.rules.wiring").stale_tensors(setup))


def _empty_optimizer(label: str, rank: tuple[int, int] | None, step: int | None) -> Finding:
    """Return AMP406 for an optimizer whose param groups hold no tensor at all."""
    why = "e.g. a requires_grad filter that matched nothing"
    if rank is not None:
        why = (f"on rank {rank[0]} of {rank[1]}: a sharded or partitioned optimizer (ZeroRedundancyOptimizer, a "
               "per-rank parameter split) can leave a rank with nothing, or a requires_grad filter matched nothing "
               "here; the other ranks may be stepping, and only this one raised")
    return get_rule("AMP406").finding(
        label, f"{label} holds no parameters: its param groups are empty ({why}), so it has nothing to step", step)


def _no_local_shard(label: str, unsharded: list[str], rank: tuple[int, int], step: int | None) -> Finding:
    """Return AMP406 for parameters FSDP sharded away from this rank entirely (0 elements here)."""
    return get_rule("AMP406").finding(
        label, f"on rank {rank[0]} of {rank[1]}, {len(unsharded)} of {label}'s parameters have no local "
        f"shard ({listing(unsharded)} are 0-element here): FSDP (use_orig_params=True) put all their elements on "
        f"other ranks, so they get no .grad on this rank, and a plain GradScaler records no inf check for "
        f"{label} on this rank only. Use ShardedGradScaler, which creates a found_inf on every rank and "
        "all-reduces it, so every rank takes the same skip decision (AMP211)", step)


def _foreign_tensors(label: str, foreign: list[str], setup: TrainingSetup, step: int | None) -> list[Finding]:
    """Return AMP406 and AMP301 for tensors of the optimizer that are not parameters of the model."""
    are = "is not a parameter" if len(foreign) == 1 else "are not parameters"
    detail = (f"{counted(len(foreign), 'tensor')} in {label} {are} of the model: {listing(foreign)}; the optimizer "
              "was built over different tensors (before a move, cast, wrap or re-creation)")
    return [get_rule("AMP406").finding(label, detail, step),
            *(_from_check("AMP301", setup, step) or [get_rule("AMP301").finding(label, detail, step)])]
