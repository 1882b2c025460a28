"""Pre-flight rules AMP101–AMP105: the dtypes of trainable parameters and how the optimizer updates them.

Only metadata is read (``dtype``, ``shape``, ``requires_grad``), so the rules work on meta-device models and cost
one pass over the parameters. How the parameter rules split the work:

* fp16 trainable parameters under an enabled GradScaler that refuses fp16 grads (not a ShardedGradScaler, nor one
  patched to accept them, as kohya-ss sd-scripts does): AMP101 (plus AMP105 when the
  optimizer is fused, which hides the error until the first explicit ``unscale_()``).
* bf16 trainable parameters under an enabled GradScaler or fp16 autocast: AMP102.
* any other fp16/bf16 trainable parameter (no scaler, a ShardedGradScaler, bf16 autocast) is updated without an fp32
  master copy: AMP103. fp16 autocast without a scaler and fp16 parameters is therefore AMP103: nothing raises, the
  update is simply pure half.

Parameters with fp32 master weights (``ampdoctor.MasterWeights``) are exempt from all five: outside forward and
backward the scaler, the optimizer and its state see fp32.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Iterator

import torch

from ampdoctor._compat.loss_scalers import loss_scaler_shape
from ampdoctor._torch.scaler import patched_to_allow_fp16, unscales_itself
from ampdoctor.core.catalog import Rule
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.findings import Finding
from ampdoctor.core.formats import BF16, FP16, lost_below
from ampdoctor.core.host_reads import to_host
from ampdoctor.core.names import listing
from ampdoctor.core.training import (
    HALF,
    ParamInfo,
    TrainingSetup,
    keeps_fp32_masters,
    unwrap_optimizer,
)
from ampdoctor.core.words import counted, word_for
from ampdoctor.preflight.rules import check, findings_by_module
from ampdoctor.preflight.rules.config import plain_scaler_enabled, scaler_label
from ampdoctor.preflight.rules.wiring import stale_tensors


def _lr_said(group: dict) -> str:
    """Return how a finding names a group's learning rate: `` (lr=3e-05)``; a scheduler's base rate where the
    group's rate is 0 at this step (a warmup's start), since an lr of 0 says nothing about the updates to come;
    nothing where neither is known.

    >>> _lr_said({"lr": 3e-5}), _lr_said({"lr": 0.0, "initial_lr": 6e-4}), _lr_said({"lr": 0.0})
    (' (lr=3e-05)', ' (base lr=0.0006, 0 at this step)', '')
    """
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) and lr.numel() == 1:
        lr = to_host(lr.reshape(()), "preflight")
    if lr is None:
        return ""
    if lr != 0:
        return f" (lr={_lr(lr)})"
    base = group.get("initial_lr")
    return f" (base lr={_lr(base)}, 0 at this step)" if isinstance(base, (int, float)) and base else ""


def _lr(value: Any) -> str:
    """Return a learning rate as people write it, three significant digits: ``0.00016666666666666666`` -> ``0.000167``.

    >>> _lr(1 / 6000), _lr(1e-4), _lr(3e-5), _lr(None)
    ('0.000167', '0.0001', '3e-05', 'None')
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1:   # a tensor lr (capturable optimizers): one read
        value = to_host(value.reshape(()), "preflight")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    return f"{value:.3g}"


def _share(low: list[ParamInfo], trainable: list[ParamInfo], dtype: torch.dtype, frozen: int,
           setup: TrainingSetup) -> str:
    """Say whether the low-precision trainable parameters are all of them or a few strays, and what usually does
    that: peft's ``modules_to_save`` copies, one model of several left out of the upcast, a cast submodule."""
    count, total, name = len(low), len(trainable), dtype_name(dtype)
    are = word_for(count, "is", "are")
    method = ".half()" if dtype == torch.float16 else ".bfloat16()"
    if count < total and all("modules_to_save" in p.name for p in low):
        return (f"{count} of {total} trainable parameters {are} {name}, all of them in peft's modules_to_save copies: "
                f"peft copies those modules in the base model's {name} (autocast_adapter_dtype upcasts the LoRA "
                "adapters only).")
    models = {next((x for x in setup.prefixes if x and p.name.startswith(x)), "") for p in low}
    if count < total and len(models) == 1 and "" not in models:   # all in one model of several...
        model = models.pop()
        if sum(p.name.startswith(model) for p in trainable) == count:   # ...and all of its trainable ones
            return (f"{count} of {total} trainable parameters {are} {name}: every one of {model[:-1]}'s, while the "
                    f"other models train in float32: {model[:-1]} was left out of the upcast (e.g. "
                    "cast_training_params given the other models only).")
    if 2 * count > total and count < total:
        return (f"{count} of {total} trainable parameters {are} {name}: most of the model was cast and a few modules "
                f"kept float32, e.g. torch_dtype=torch.{name} with transformers' _keep_in_fp32_modules.")
    if count < total:
        return (f"{count} of {total} trainable parameters {are} {name}: stray casts of a few modules or parameters "
                f"(a {method} or .to(torch.{name}) on one submodule, or an nn.Parameter created in {name}).")
    everything = "the only trainable parameter is" if total == 1 else f"all {total} trainable parameters are"
    if frozen:
        return (f"{everything} {name} (next to {counted(frozen, 'frozen parameter')}): the trainable part (adapters, "
                f"heads) was created in or cast to the base model's {name}, e.g. peft with "
                "autocast_adapter_dtype=False or a .to(dtype) after adding adapters.")
    return f"{everything} {name}: the whole model was cast, e.g. torch_dtype=torch.{name} or {method}."


def _master_weights_module() -> Any:
    # Nothing can be managed by MasterWeights unless its module was imported, so look, don't import.
    return sys.modules.get("ampdoctor.repairs.master_weights")


def is_master_weights(opt: torch.optim.Optimizer) -> bool:
    """Return whether ``opt`` is an ``ampdoctor.MasterWeights``, which keeps fp32 master copies.

    >>> is_master_weights(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    False
    """
    return keeps_fp32_masters(opt)


def has_master(setup: TrainingSetup) -> Callable[[torch.Tensor], bool]:
    """Return a predicate: does this parameter have fp32 master weights (``ampdoctor.MasterWeights``)?

    Such a parameter is half only for forward and backward; ``unscale_()``, clipping and the optimizer see the fp32
    master and an fp32 gradient, so the parameter rules leave it alone.
    """
    managed = set()
    for opt in setup.optimizers:
        if is_master_weights(opt):
            managed.update(id(t) for g in opt.param_groups for t in g["params"])
    is_managed = getattr(_master_weights_module(), "is_managed", None)  # also when only the inner optimizer is passed
    if is_managed is None:
        return (lambda tensor: id(tensor) in managed) if managed else (lambda tensor: False)
    return lambda tensor: id(tensor) in managed or is_managed(tensor)


def _trainable_counts(setup: TrainingSetup) -> tuple[list[ParamInfo], int]:
    trainable = setup.trainable()
    return trainable, len(setup.params) - len(trainable)


def _unmastered(setup: TrainingSetup, params: Iterable[ParamInfo], dtype: torch.dtype) -> list[ParamInfo]:
    mastered = has_master(setup)
    return [p for p in params if p.dtype == dtype and not mastered(p.param)]


@check("AMP101")
def fp16_trainable_params(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Name every trainable float16 parameter when an enabled GradScaler refuses fp16 gradients.

    >>> setup = TrainingSetup(torch.nn.Linear(2, 2).half(), scaler=torch.amp.GradScaler("cpu"))
    >>> [(f.code, f.where) for f in fp16_trainable_params(setup)]
    [('AMP101', '(root)')]
    """
    if not plain_scaler_enabled(setup):
        return
    trainable, frozen = _trainable_counts(setup)
    free = _free_standing(setup, torch.float16)
    fp16 = _unmastered(setup, trainable, torch.float16) + free
    if not fp16:
        return
    state = (f"trainable float16 while {scaler_label(setup.scaler)} is enabled, so scaler.unscale_() will raise "
             "'Attempting to unscale FP16 gradients.'")
    yield from findings_by_module(rule, fp16, state, _share(fp16, trainable + free, torch.float16, frozen, setup))


def _free_standing(setup: TrainingSetup, dtype: torch.dtype) -> list[ParamInfo]:
    """Return the trainable ``dtype`` tensors outside the models that the optimizers step next to the models' own
    (a logit scale kept outside the model), named where the optimizer holds them (``param_groups[g]['params'][i]``,
    as the watch and the explanations name them) in ``optimizer[o] group g``: they get gradients as the model's
    parameters do. Stale tensors (AMP301's) get none, so they are left out."""
    if not setup.models:
        return []
    stale, mastered = stale_tensors(setup), has_master(setup)
    return [ParamInfo(setup.name_of(t, optimizer=opt), f"optimizer[{oi}] group {gi}", t)
            for oi, opt in enumerate(setup.optimizers) for gi, group in enumerate(opt.param_groups)
            for t in group["params"]
            if t.dtype == dtype and t.requires_grad and setup.info(t) is None and id(t) not in stale
            and not mastered(t)]


@check("AMP102")
def bf16_params_under_fp16_amp(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Name every trainable bfloat16 parameter under an enabled GradScaler or fp16 autocast.

    >>> setup = TrainingSetup(torch.nn.Linear(2, 2).bfloat16(), autocast_dtype=torch.float16)
    >>> [f.code for f in bf16_params_under_fp16_amp(setup)]
    ['AMP102']
    """
    contexts = []
    if setup.scaler_enabled:
        contexts.append(f"{scaler_label(setup.scaler)} is enabled")
    if setup.autocast_dtype == torch.float16:
        contexts.append("autocast runs in float16")
    if not contexts:
        return
    trainable, frozen = _trainable_counts(setup)
    free = _free_standing(setup, torch.bfloat16)
    bf16 = _unmastered(setup, trainable, torch.bfloat16) + free
    if not bf16:
        return
    # the CUDA unscale kernel has lacked bfloat16 (pytorch #127176); the CPU kernel has it
    cuda = (" (on CUDA, torch versions without a bfloat16 unscale kernel raise \"not implemented for 'BFloat16'\" in "
            "scaler.step())" if setup.scaler_enabled else "")
    state = f"trainable bfloat16 while {' and '.join(contexts)}{cuda}"
    yield from findings_by_module(rule, bf16, state, _share(bf16, trainable + free, torch.bfloat16, frozen, setup))


def _reported_elsewhere(setup: TrainingSetup) -> set[torch.dtype]:
    """Return the half dtypes whose trainable parameters AMP101/AMP102 already report."""
    covered = set()
    if plain_scaler_enabled(setup):
        covered.add(torch.float16)
    if setup.scaler_enabled or setup.autocast_dtype == torch.float16:
        covered.add(torch.bfloat16)
    return covered


def _dtype_counts(tensors: Iterable[torch.Tensor]) -> str:
    counts: dict[torch.dtype, int] = {}
    for t in tensors:
        counts[t.dtype] = counts.get(t.dtype, 0) + 1
    return ", ".join(f"{n} {dtype_name(d)}" for d, n in counts.items())


# w + u == w when |u| is below half an ulp of w: always below these (core.formats.lost_below)
_LOST_BELOW = {torch.float16: lost_below(FP16), torch.bfloat16: lost_below(BF16)}


@check("AMP103")
def pure_half_without_master(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag fp16/bf16 trainable parameters that an optimizer updates with no fp32 master copy.

    >>> model = torch.nn.Linear(2, 2).bfloat16()
    >>> setup = TrainingSetup(model, torch.optim.SGD(model.parameters(), lr=0.1), autocast_dtype=torch.bfloat16)
    >>> [f.where for f in pure_half_without_master(setup)]
    ['optimizer[0] group 0']
    """
    half = tuple(d for d in HALF if d not in _reported_elsewhere(setup))
    if not half:
        return
    scaler = scaler_label(setup.scaler) if setup.scaler_enabled else _library_scaler(setup) or "no enabled GradScaler"
    if setup.scaler_enabled and patched_to_allow_fp16(setup.scaler):
        scaler += " (its _unscale_grads_ patched to accept float16 gradients, so unscale_() does not raise)"
    mastered = has_master(setup)
    if not setup.optimizers:
        trainable = setup.trainable()
        members = [p for p in trainable if p.dtype in half and not mastered(p.param)]
        if members:
            present = [d for d in half if any(p.dtype == d for p in members)]
            yield rule.finding(
                "model",
                f"{len(members)} of {len(trainable)} trainable parameters are half precision "
                f"({_dtype_counts(p.param for p in members)}): {listing([p.describe() for p in members])}; with "
                f"{scaler} and no MasterWeights optimizer given, they will be updated in place in half precision. "
                f"An update smaller than {' or '.join(_LOST_BELOW[d] for d in present)} rounds away.",
            )
        return
    groups = []
    for oi, opt in enumerate(setup.optimizers):
        for gi, group in enumerate(opt.param_groups):
            members = [(i, t) for i, t in enumerate(group["params"])
                       if t.requires_grad and t.dtype in half and not mastered(t)]
            if members:
                groups.append((f"optimizer[{oi}] group {gi}", type(unwrap_optimizer(opt)).__name__,
                               _lr_said(group), len(group["params"]), members, "updates"))
    if len(setup.optimizers) > 3 and len(groups) > 3 and len({(g[1], g[2]) for g in groups}) == 1:
        # one optimizer per parameter (torchtune's optimizer in backward): one finding, not one per parameter
        groups = [(f"{len(setup.optimizers)} optimizers", f"{len(groups)} {groups[0][1]} optimizers (as when each "
                   "parameter has its own, stepped in backward)", groups[0][2], sum(g[3] for g in groups),
                   [m for g in groups for m in g[4]], "update")]
    for where, name, lr, total, members, verb in groups:
        dtypes = sorted({t.dtype for _, t in members}, key=str)
        yield rule.finding(
            where,
            f"{name}{lr} {verb} {len(members)} of {total} tensors in place in "
            f"half precision ({_dtype_counts(t for _, t in members)}), with {scaler} and no fp32 master copy: "
            f"{listing([setup.describe(t) for _, t in members])}. An update smaller than "
            f"{' or '.join(_LOST_BELOW[d] for d in dtypes)} rounds away.",
        )


def _library_scaler(setup: TrainingSetup) -> str | None:
    """Return how a library's own live loss scaler is named (``DynamicLossScaler (fairseq)``), None without one."""
    shape = loss_scaler_shape(setup.loss_scaler) if setup.loss_scaler is not None else None
    return None if shape is None else shape.label(setup.loss_scaler)


# Adam classes that step half parameters in float32 (an fp32 copy of the parameter, fp32 exp_avg/exp_avg_sq, eps
# added in fp32, the result written back): fairseq's own Adam (fairseq/optim/adam.py, 3d262bb2), by module and name
_STEPS_IN_FP32 = {("fairseq.optim.adam", "Adam")}


def _is_adam_family(group: dict) -> bool:
    return "eps" in group and "betas" in group


def _smallest_subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.tiny * info.eps  # fp16: 2**-14 · 2**-10 = 2**-24 ≈ 5.96e-8; bf16: 2**-133 ≈ 9.2e-41


@check("AMP104")
def adam_eps_underflow(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag an Adam-family eps below the smallest subnormal of its parameters' or state's half dtype.

    >>> model = torch.nn.Linear(2, 2).half()
    >>> [f.where for f in adam_eps_underflow(TrainingSetup(model, torch.optim.AdamW(model.parameters())))]
    ['optimizer[0] group 0']
    """
    mastered = has_master(setup)  # the optimizer sees their fp32 masters and keeps fp32 state
    for oi, opt in enumerate(setup.optimizers):
        inner = unwrap_optimizer(opt)
        for gi, group in enumerate(opt.param_groups):
            if not _is_adam_family(group) or group.get("fused"):
                continue  # fused Adam kernels add eps in float32 (opmath), so it cannot underflow there
            eps = group["eps"]
            if not isinstance(eps, (int, float)) or eps <= 0:
                continue
            floors = {d: _smallest_subnormal(d) for d in HALF if eps < _smallest_subnormal(d)}
            if not floors:
                continue  # e.g. eps=1e-8 is fine for everything but fp16
            if (type(inner).__module__, type(inner).__name__) in _STEPS_IN_FP32:
                continue  # eps is added in float32 whatever the parameter's dtype
            state = inner.state if len(inner.state) else {}  # fp32 params may still keep half state
            for dtype, names in _half_tensors(setup, group, state, floors, mastered).items():
                yield _eps_finding(rule, f"optimizer[{oi}] group {gi}", type(inner).__name__, eps, dtype, names)


def _half_tensors(setup: TrainingSetup, group: dict, state: dict, floors: dict[torch.dtype, float],
                  mastered: Callable[[torch.Tensor], bool]) -> dict[torch.dtype, list[str]]:
    """Return, by half dtype of ``floors``, the names of the group's trainable tensors whose Adam step adds eps in
    that dtype: the parameter itself, or its ``exp_avg_sq`` (an fp32 parameter may keep half state)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for t in group["params"]:
        if not t.requires_grad or mastered(t):
            continue
        sq = state.get(t, {}).get("exp_avg_sq") if state else None
        if isinstance(sq, torch.Tensor) and sq.dtype == torch.float32:
            continue  # the optimizer keeps fp32 state for it: eps is added in float32
        if t.dtype in floors:
            by_dtype.setdefault(t.dtype, []).append(setup.name_of(t, f"{list(t.shape)} tensor"))
            continue
        if isinstance(sq, torch.Tensor) and sq.dtype in floors:
            by_dtype.setdefault(sq.dtype, []).append(f"exp_avg_sq of {setup.name_of(t, 'a tensor')}")
    return by_dtype


def _eps_finding(rule: Rule, where: str, optimizer: str, eps: float, dtype: torch.dtype, names: list[str]) -> Finding:
    """Return AMP104 for ``eps`` added in ``dtype`` to the tensors ``names``: what it becomes there, and the harm."""
    rounded = torch.tensor(eps, dtype=dtype).item()
    became = "is 0" if rounded == 0 else f"rounds to {rounded:.3g}"
    return rule.finding(
        where,
        f"{optimizer} eps={eps:g} {became} in {dtype_name(dtype)}, whose smallest subnormal "
        f"is {_smallest_subnormal(dtype):.3g}; the group updates {counted(len(names), dtype_name(dtype) + ' tensor')} "
        f"({listing(names)}). "
        + ("Where exp_avg_sq is 0 (a zero gradient) the step is 0/(0+0) = NaN." if rounded == 0 else
           f"eps is applied as {rounded:.3g}, not {eps:g}, with one bit of precision."),
    )


def _is_fused(opt: torch.optim.Optimizer) -> bool:
    inner = unwrap_optimizer(opt)
    return unscales_itself(inner) or any(
        g.get("fused") for g in inner.param_groups)


@check("AMP105")
def fused_optimizer_fp16_params(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag a fused optimizer over float16 parameters, where GradScaler.step() skips the fp16 check.

    >>> model = torch.nn.Linear(2, 2).half()
    >>> opt = torch.optim.AdamW(model.parameters(), fused=True)
    >>> [f.where for f in fused_optimizer_fp16_params(TrainingSetup(model, opt, torch.amp.GradScaler("cpu")))]
    ['optimizer[0]']
    """
    if not plain_scaler_enabled(setup):
        return
    mastered = has_master(setup)
    for oi, opt in enumerate(setup.optimizers):
        if not _is_fused(opt):
            continue
        fp16 = [(i, t) for g in opt.param_groups for i, t in enumerate(g["params"])
                if t.requires_grad and t.dtype == torch.float16 and not mastered(t)]
        if not fp16:
            continue
        yield rule.finding(
            f"optimizer[{oi}]",
            f"fused {type(unwrap_optimizer(opt)).__name__} steps {counted(len(fp16), 'float16 trainable tensor')} "
            f"({listing([setup.describe(t, opt) for _, t in fp16])}) under {scaler_label(setup.scaler)}. "
            "scaler.step() only checks fused optimizers for inf (allow_fp16=True), so it raises nothing and "
            "training is silently pure fp16 with no fp32 master copy; the first explicit scaler.unscale_(opt), "
            "e.g. before clip_grad_norm_, raises 'Attempting to unscale FP16 gradients.'",
        )
