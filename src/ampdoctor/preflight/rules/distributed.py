"""Pre-flight rules AMP210–AMP212: how gradients are reduced across ranks, whether ranks agree on skipping a step,
and training engines that own mixed precision themselves.

The FSDP units are read by ``fsdp.py``; like it, nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from ampdoctor._compat.engines import Engine, find_engines
from ampdoctor._torch.distributed import dtensor_reduces_found_inf
from ampdoctor.core.catalog import Rule
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.names import listing
from ampdoctor.core.training import TrainingSetup, unwrap_optimizer
from ampdoctor.core.words import counted, word_for
from ampdoctor.preflight.rules import check
from ampdoctor.preflight.rules.config import plain_scaler_enabled, scaler_label
from ampdoctor.preflight.rules.fsdp import FsdpUnit, fsdp_units


def _reduce_cost(dtype: torch.dtype, ranks: int) -> str:
    if dtype == torch.float16:
        root = math.sqrt(ranks)
        return (f"In fp16 the reduction divides by about sqrt({ranks}) ≈ {root:.3g} before the sum and after it, so a "
                f"gradient entry above 65504/{root:.3g} ≈ {65504 / root:.3g} overflows to inf (a skipped step) and "
                f"one below 2**-24·{root:.3g} ≈ {2 ** -24 * root:.2g} flushes to 0; both limits move the wrong way "
                "as ranks are added")
    return (f"In bf16 each of the {counted(ranks - 1, 'partial sum')} of the reduction rounds to 8 significant "
            f"bits (a relative error up to about {ranks - 1}·2**-9 ≈ {(ranks - 1) * 2 ** -9:.2g}), so what one "
            "rank adds below 1/256 of the running sum is lost")


@check("AMP210")
def fsdp_low_precision_reduce(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag FSDP units that sum gradients over two or more ranks in fp16 or bf16.

    >>> list(fsdp_low_precision_reduce(TrainingSetup(torch.nn.Linear(2, 2))))
    []
    """
    by_dtype: dict[torch.dtype, list[FsdpUnit]] = {}
    for unit in fsdp_units(setup):
        if unit.reduce_dtype in (torch.float16, torch.bfloat16) and (unit.ranks or 0) >= 2:
            by_dtype.setdefault(unit.reduce_dtype, []).append(unit)
    for dtype, units in by_dtype.items():
        ranks = max(u.ranks or 0 for u in units)
        kinds = sorted({u.kind for u in units})
        unit = units[0]
        if unit.set_reduce is not None:
            how = f"reduce_dtype={dtype_name(dtype)} was set"
        elif unit.param_dtype is not None:
            how = f"param_dtype={dtype_name(dtype)} and reduce_dtype is not set, so it defaults to param_dtype"
        else:
            how = f"the parameters themselves are {dtype_name(dtype)}"
        yield rule.finding(
            units[0].name,
            f"{len(units)} {' and '.join(kinds)} {word_for(len(units), 'unit')} "
            f"({listing([u.name for u in units], 5)}) {'sums its' if len(units) == 1 else 'sum their'} gradients "
            f"over {ranks} ranks in {dtype_name(dtype)}: {how}. {_reduce_cost(dtype, ranks)}. Set "
            "reduce_dtype=torch.float32 (the optimizer's sharded gradients stay in the parameters' dtype).",
            severity=Severity.WARNING if dtype == torch.float16 else Severity.INFO,
        )


@check("AMP211")
def rank_local_skip(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag sharded FSDP gradients under an enabled GradScaler that does not all-reduce its found_inf.

    FSDP1 units computing in fp16 are AMP205's (whose scaler also refuses their gradients); FSDP2 is quiet on a
    torch whose DTensor all-reduces ``found_inf`` (MAX) for a plain GradScaler.

    >>> list(rank_local_skip(TrainingSetup(torch.nn.Linear(2, 2), scaler=torch.amp.GradScaler("cpu"))))
    []
    """
    if not plain_scaler_enabled(setup):
        return
    synced = dtensor_reduces_found_inf()
    units = [u for u in fsdp_units(setup)
             if u.sharded and (u.ranks or 0) >= 2 and u.param_dtype != torch.float16 and not (u.fsdp2 and synced)]
    if not units:
        return
    ranks = max(u.ranks or 0 for u in units)
    yield rule.finding(
        units[0].name,
        f"{counted(len(units), 'FSDP unit')} ({listing([u.name for u in units], 5)}) "
        f"{'shards its' if len(units) == 1 else 'shard their'} gradients over {ranks} ranks "
        f"and the scaler is {scaler_label(setup.scaler)}, not a ShardedGradScaler: scaler.step() checks only this "
        "rank's shard for inf/NaN, so an overflow in one rank's shard skips the step there while the other ranks "
        "apply it, and the ranks' loss scales drift apart from then on. Compare after the run: each rank's skipped "
        "steps and loss scale per step (AMP411).",
    )


def engines_of(setup: TrainingSetup) -> list[Engine]:
    """Return the DeepSpeed / Megatron-LM / apex engines behind the setup (found once, then kept on it)."""
    if setup.found_engines is None:
        setup.found_engines = find_engines(setup.models, setup.optimizers, setup.engines)
    return setup.found_engines


def without_engines(setup: TrainingSetup) -> TrainingSetup:
    """Return the setup without the models and optimizers an engine owns (its fp32 flat partitions, its model)."""
    engines = engines_of(setup)
    if not engines:
        return setup
    params = set().union(*(e.params for e in engines))
    optimizers = set().union(*(e.optimizers for e in engines))
    models = [m for m in setup.models if not any(id(p) in params for p in m.parameters())]
    kept = [o for o in setup.optimizers if id(o) not in optimizers and id(unwrap_optimizer(o)) not in optimizers]
    rest = TrainingSetup(models, kept, setup.scaler, setup.autocast_dtype, setup.accelerator, setup.facts)
    rest.found_engines = []
    return rest


@check("AMP212")
def engine_owns_precision(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Say, once per engine, that DeepSpeed, Megatron-LM or apex owns mixed precision and what its config says.

    >>> list(engine_owns_precision(TrainingSetup(torch.nn.Linear(2, 2))))
    []
    """
    for engine in engines_of(setup):
        if engine.mode == "fp32":
            continue   # no fp16 or bf16 anywhere: nothing mixed-precision to say (its objects still stay out)
        inner = [o for o in setup.optimizers
                 if id(unwrap_optimizer(o)) in engine.optimizers or id(o) in engine.optimizers]
        stepped = f", stepped by {', '.join(type(unwrap_optimizer(o)).__name__ for o in inner)}" if inner else ""
        said = "; ".join(engine.precision) or "its precision settings were not readable"
        if engine.mode is not None and engine.mode.startswith("autocast"):
            does = f"it runs the forward under autocast with fp32 parameters{stepped}"
        else:
            does = f"it keeps fp32 master copies{stepped}"
        if engine.loss_scaled:
            does += ", and scales the loss and checks for overflow itself, across ranks"
            logs = "; its loss scale and skipped steps are in its own logs ('OVERFLOW! Rank N Skipping step')"
        else:
            does += " (bf16 needs no loss scale)"
            logs = ""
        owned = engine.model_params if engine.model_params is not None else len(engine.params)
        yield rule.finding(
            type(engine.obj).__name__,
            f"{engine.family} ({engine.label}) owns mixed precision here ({said}): {does}. ampdoctor leaves its "
            f"{counted(owned, 'model parameter')} and its optimizer out of AMP1xx-AMP3xx, and --fix does not touch "
            f"them{logs}.",
        )
