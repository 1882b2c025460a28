"""Pre-flight rules AMP201–AMP205 and AMP209: how the GradScaler, autocast, accelerate (and the transformers
Trainer that builds an Accelerator) and FSDP are configured.

The scaler helpers here (`is_sharded_scaler`, `plain_scaler_enabled`, `scaler_label`) are shared with the other
rule modules. Nothing here imports ``torch.distributed`` or ``accelerate``: a user object can only be an instance of
a class whose module is already imported, so the rules look the class up in ``sys.modules`` (importing
``torch.distributed.fsdp`` costs about a second when nothing else has).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Iterator

import torch

from ampdoctor._compat.transformers import trainer_of
from ampdoctor._torch.distributed import dtensor_reduces_found_inf
from ampdoctor._torch.scaler import init_scale, is_enabled, patched_to_allow_fp16, scaler_device
from ampdoctor.core.catalog import Rule
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.findings import Finding
from ampdoctor.core.names import Names, listing
from ampdoctor.core.training import TrainingSetup, keeps_fp32_masters, unwrap_optimizer
from ampdoctor.core.words import counted
from ampdoctor.preflight.rules import check
from ampdoctor.preflight.rules.fsdp import fsdp_units, loaded_class


def is_sharded_scaler(scaler: Any) -> bool:
    """Return whether ``scaler`` is an FSDP ``ShardedGradScaler``, which allows fp16 gradients."""
    cls = loaded_class("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler")
    return cls is not None and isinstance(scaler, cls)


def plain_scaler_enabled(setup: TrainingSetup) -> bool:
    """Return whether an enabled GradScaler that refuses fp16 gradients is present: not a ShardedGradScaler, nor
    one whose ``_unscale_grads_`` was patched to accept them (``patched_to_allow_fp16``)."""
    return setup.scaler_enabled and not is_sharded_scaler(setup.scaler) and not patched_to_allow_fp16(setup.scaler)


def scaler_label(scaler: Any) -> str:
    """Return how the scaler was built.

    >>> scaler_label(torch.amp.GradScaler("cpu"))
    "GradScaler('cpu')"
    """
    return Names.scaler(scaler, scaler_device(scaler))


@check("AMP201")
def scaler_with_bf16_autocast(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag an enabled GradScaler while autocast runs in bfloat16.

    >>> setup = TrainingSetup(torch.nn.Linear(2, 2), scaler=torch.amp.GradScaler("cpu"), autocast_dtype=torch.bfloat16)
    >>> [f.where for f in scaler_with_bf16_autocast(setup)]
    ['GradScaler']
    """
    if not setup.scaler_enabled or setup.autocast_dtype != torch.bfloat16:
        return
    scaler = setup.scaler
    start = init_scale(scaler)
    shown = "?" if start is None else f"{start:g}"
    yield rule.finding(
        "GradScaler",
        f"{scaler_label(scaler)} is enabled (init_scale={shown}) while autocast runs in "
        "bfloat16. bfloat16 has float32's 8 exponent bits (max ≈ 3.4e38, smallest normal ≈ 1.2e-38), so gradients "
        "need no loss scaling; scale(), unscale_() and update() only add work (and on CUDA, torch versions "
        "without a bfloat16 unscale kernel raise on bfloat16 gradients).",
    )


@check("AMP202")
def cuda_scaler_disabled(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag a GradScaler('cuda') that torch disabled because CUDA is not available.

    >>> setup = TrainingSetup(torch.nn.Linear(2, 2), scaler=torch.amp.GradScaler("cpu"))
    >>> list(cuda_scaler_disabled(setup))
    []
    """
    scaler = setup.scaler
    if scaler is None or scaler_device(scaler) != "cuda" or is_enabled(scaler):
        return
    if setup.autocast_dtype == torch.bfloat16:
        return  # a disabled scaler is what bf16 wants, however it came about
    requested = setup.facts.scaler_requested_enabled(scaler) if setup.facts is not None else None
    if requested is not True:
        # enabled=False was passed (nanoGPT's GradScaler('cuda', enabled=(dtype == 'float16'))), or the
        # construction was not observed: a disabled scaler by choice is no problem.
        return
    half = any(p.dtype == torch.float16 for p in setup.params)   # trainable or frozen: both make fp16 gradients
    if setup.autocast_dtype == torch.float16:
        effect = ("the forward runs under fp16 autocast, so fp16 gradients get no loss scaling: values below "
                  "2**-24 ≈ 6e-8 flush to zero and the run can stall")
    elif half:
        effect = ("the model's float16 layers make float16 gradients with no loss scaling: values below "
                  "2**-24 ≈ 6e-8 flush to zero")
    else:
        # no fp16 in play (nanoGPT on a CPU: no autocast there, fp32 weights): the run is plain fp32, unharmed
        return
    yield rule.finding(
        "GradScaler",
        f"{scaler_label(scaler)} was built with enabled=True, but torch.cuda.is_available() is False, so torch "
        "disabled it at construction (its UserWarning: 'torch.cuda.amp.GradScaler is enabled, but CUDA is not "
        f"available.  Disabling.'). scale() returns the loss unchanged and step() is a plain optimizer.step(); "
        f"{effect}.",
    )


# accelerate leaves these to the engine, which owns fp16 and its loss scaler
_ENGINE_OWNS_FP16 = {"DEEPSPEED", "MEGATRON_LM"}


@check("AMP208")
def fp16_autocast_without_scaler(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag fp16 compute with no enabled GradScaler (plain or sharded) to scale the loss: a forward under fp16
    autocast, or FSDP units whose ``param_dtype`` is float16 (FSDP casts the parameters; no autocast is involved).

    >>> model = torch.nn.Linear(2, 2)
    >>> [f.code for f in fp16_autocast_without_scaler(TrainingSetup(model, autocast_dtype=torch.float16))]
    ['AMP208']
    >>> list(fp16_autocast_without_scaler(TrainingSetup(model, autocast_dtype=torch.bfloat16)))
    []
    """
    if setup.scaler_enabled:
        return
    trainable = setup.trainable()
    if not trainable or all(p.dtype in (torch.float16, torch.bfloat16) for p in trainable):
        return  # nothing trains, or pure half training: AMP103's case
    scaler = "no GradScaler" if setup.scaler is None else scaler_label(setup.scaler) + " is disabled"
    if setup.autocast_dtype == torch.float16:
        yield rule.finding(
            "torch.autocast",
            f"the forward runs under fp16 autocast and no enabled GradScaler scales the loss ({scaler}): the "
            f"backward of the {len(trainable)} trainable tensors runs in fp16, where gradients below 2**-24 ≈ 6e-8 "
            "flush to 0 and those below 2**-14 ≈ 6.1e-5 lose precision.",
        )
        return
    units = [u for u in fsdp_units(setup) if u.param_dtype == torch.float16]
    if units:   # FSDP casts the parameters to fp16 for the forward and the backward: fp16 compute, no autocast
        sharded = "torch.amp.GradScaler" if all(u.fsdp2 for u in units) and dtensor_reduces_found_inf() else \
            "ShardedGradScaler (torch.distributed.fsdp.sharded_grad_scaler)"
        yield rule.finding(
            units[0].name,
            f"{counted(len(units), 'FSDP unit')} compute{'s' if len(units) == 1 else ''} in float16 "
            f"({units[0].policy}: {listing([u.name for u in units], 5)}) "
            f"and no enabled GradScaler scales the loss ({scaler}): their backward runs in fp16, where gradients "
            "below 2**-24 ≈ 6e-8 flush to 0 and those below 2**-14 ≈ 6.1e-5 lose precision. Scale the loss with a "
            f"{sharded}, or set param_dtype=torch.bfloat16.",
        )


@check("AMP203")
def accelerate_fp16_not_in_effect(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag an ``Accelerator(mixed_precision="fp16")`` that neither autocasts nor scales.

    >>> list(accelerate_fp16_not_in_effect(TrainingSetup(torch.nn.Linear(2, 2))))  # no accelerator
    []
    """
    acc = setup.accelerator
    if acc is None or str(getattr(acc, "mixed_precision", "")) != "fp16":
        return
    kind = getattr(getattr(acc, "distributed_type", None), "value", str(getattr(acc, "distributed_type", "")))
    if str(kind).upper() in _ENGINE_OWNS_FP16:
        return
    native_amp = bool(getattr(acc, "native_amp", False))
    scaler = getattr(acc, "scaler", None)
    if native_amp and scaler is not None:
        return
    device = getattr(acc, "device", None)
    device_type = getattr(device, "type", str(device))
    accelerate = sys.modules.get("accelerate")
    version = getattr(accelerate, "__version__", "?")
    if device_type == "cpu":
        # accelerate (1.x, read in 1.15 Accelerator.__init__) sets up fp16 only when `self.device.type != "cpu"`;
        # on CPU it neither raises nor warns.
        how = (f"on device {str(device)!r}: accelerate {version} only sets up fp16 when the device is not CPU, so it "
               f"left native_amp={native_amp} and created no GradScaler (accelerator.scaler is "
               f"{'None' if scaler is None else scaler_label(scaler)}), and raised no error")
    else:
        how = (f"on device {str(device)!r} with native_amp={native_amp} and accelerator.scaler="
               f"{'None' if scaler is None else scaler_label(scaler)} (accelerate {version})")
    framework, asked = _framework(setup)
    yield rule.finding(
        "Accelerator",
        f"{asked} reports mixed_precision='fp16' {how}. prepare() therefore does not wrap forward in "
        "torch.autocast, accelerator.autocast() is a no-op and accelerator.backward() does not scale the loss: "
        f"{_what_runs(setup)}",
        fix=_PRECISION_FIX[framework] + ("   # on CPU; keep fp16 for CUDA runs" if device_type == "cpu" else ""),
    )


@check("AMP213")
def lightning_fp16_became_bf16(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Say that a Lightning ``Trainer`` or ``Fabric`` built with ``precision="16-mixed"`` set up something else (on
    a CPU: ``bf16-mixed``), as the process-wide observers saw at its construction.

    >>> list(lightning_fp16_became_bf16(TrainingSetup(torch.nn.Linear(2, 2))))   # no construction seen
    []
    """
    if setup.facts is None:
        return
    for framework, asked, got in setup.facts.precision_fallbacks():
        yield rule.finding(
            framework,
            f"{framework}(precision={asked!r}) set up precision={got!r}: Lightning does so on a CPU, where it "
            f"has no fp16 autocast. The run computes in {'bf16' if got.startswith('bf16') else got} with no "
            "GradScaler, so the loss scale and the fp16 overflows of the run to come are not tested here.",
        )


# the line that asks each framework for bf16 mixed precision, which accelerate sets up on CPU too
_PRECISION_FIX = {"transformers": "args = TrainingArguments(..., bf16=True)",
                  "lightning": 'trainer = Trainer(precision="bf16-mixed")',
                  "accelerate": "accelerator = Accelerator(mixed_precision='bf16')"}


def _framework(setup: TrainingSetup) -> tuple[str, str]:
    """Return which framework built the run's Accelerator, and how fp16 was asked of it: ``"transformers"`` (a
    Trainer holds it), ``"lightning"`` (a LightningModule is trained), else ``"accelerate"`` (the script's own)."""
    owner = trainer_of(setup.accelerator)
    if owner is not None:
        flag = "TrainingArguments(fp16=True)" if getattr(getattr(owner, "args", None), "fp16", False) else \
            "ACCELERATE_MIXED_PRECISION=fp16"
        return "transformers", f"The Accelerator that transformers' Trainer built for {flag}"
    asked = "Accelerator(mixed_precision='fp16')"
    lightning = tuple(c for c in (loaded_class("lightning.pytorch.core.module", "LightningModule"),
                                  loaded_class("pytorch_lightning.core.module", "LightningModule")) if c is not None)
    if lightning and any(isinstance(m, lightning) for m in setup.models):
        return "lightning", asked
    return "accelerate", asked


def _what_runs(setup: TrainingSetup) -> str:
    """Say in which dtypes the model computes with neither autocast nor loss scaling: its parameters' own."""
    trainable = sorted({dtype_name(p.dtype) for p in setup.trainable()})
    frozen = sorted({dtype_name(p.dtype) for p in setup.params if not p.param.requires_grad})
    dtypes = sorted(set(trainable + frozen))
    if len(dtypes) <= 1:
        shown = dtypes[0] if dtypes else "its parameters' dtype"
        return f"the model trains in {shown}, not fp16 mixed precision."
    said = f"the trainable parameters are {'/'.join(trainable) or '(none)'}"
    said += f" and the frozen ones {'/'.join(frozen)}" if frozen else ""
    each = " and ".join(f"those with {d} weights in {d}" for d in dtypes)
    return (f"{said}. With no autocast each layer computes in its weights' dtype ({each}), with no loss "
            "scaling: not the fp16 mixed precision asked for.")


_NAMED = 5   # half parameters named in AMP209's detail


@check("AMP209")
def trainer_flag_on_half_model(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag ``TrainingArguments(fp16=True)``/``(bf16=True)`` on a model whose trainable parameters are half.

    The flags ask accelerate for fp32 weights under fp16/bf16 autocast; a model loaded with ``dtype=torch.float16``
    (or cast with ``.half()``) has half weights instead, updated in half precision by a plain optimizer. The
    Trainer is the one that holds the run's Accelerator (``_compat.transformers.trainer_of``): found by the
    Trainer callback, ``ampdoctor run`` and ``check(..., accelerator=trainer.accelerator)`` alike.

    >>> list(trainer_flag_on_half_model(TrainingSetup(torch.nn.Linear(2, 2).half())))  # no Trainer
    []
    """
    trainable = setup.trainable()
    half = [p for p in trainable if p.dtype in (torch.float16, torch.bfloat16)]
    if not half or setup.accelerator is None:
        return   # the cheap checks first: the Trainer is found through gc
    args = getattr(trainer_of(setup.accelerator), "args", None)
    flag = "fp16" if getattr(args, "fp16", False) else "bf16" if getattr(args, "bf16", False) else None
    if flag is None or getattr(args, "deepspeed", None) or any(keeps_fp32_masters(o) for o in setup.optimizers):
        return   # DeepSpeed and MasterWeights keep fp32 master weights of half parameters
    dtypes = " and ".join(sorted({dtype_name(p.dtype) for p in half}))
    names = ", ".join(p.describe() for p in half[:_NAMED]) + (f" and {len(half) - _NAMED} more"
                                                               if len(half) > _NAMED else "")
    whole = "all" if len(half) == len(trainable) else f"{len(half)} of"
    consequence = ("a GradScaler refuses their float16 gradients ('Attempting to unscale FP16 gradients')"
                   if setup.scaler_enabled and any(p.dtype == torch.float16 for p in half) else
                   "the optimizer updates them in half precision, where small updates round away")
    yield rule.finding(f"TrainingArguments({flag}=True)", (
        f"{flag}=True means fp32 weights with {flag} autocast, but {whole} {len(trainable)} trainable parameters are "
        f"{dtypes}: {names}. The model was loaded or cast in half precision (from_pretrained(..., "
        f"dtype=torch.{dtypes.split()[0]}) or .half()), so {consequence}."))


def _requires_closure(opt: torch.optim.Optimizer) -> bool:
    if isinstance(opt, torch.optim.LBFGS):
        return True
    try:
        closure = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


@check("AMP204")
def closure_with_scaler(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag an optimizer whose step needs a closure (LBFGS) next to an enabled GradScaler.

    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.LBFGS(model.parameters())
    >>> [f.where for f in closure_with_scaler(TrainingSetup(model, opt, torch.amp.GradScaler("cpu")))]
    ['optimizer[0]']
    """
    if not setup.scaler_enabled:
        return
    for index, opt in enumerate(setup.optimizers):
        inner = unwrap_optimizer(opt)
        if _requires_closure(inner):
            yield rule.finding(
                f"optimizer[{index}]",
                f"{type(inner).__name__}.step needs a closure that re-evaluates the loss, and "
                f"{scaler_label(setup.scaler)} is enabled: scaler.step(opt, closure) raises 'Closure use is not "
                "currently supported if GradScaler is enabled.' (GradScaler cannot rescale a loss computed inside "
                "the step).",
            )


@check("AMP205")
def fsdp_fp16_with_plain_scaler(setup: TrainingSetup, rule: Rule) -> Iterator[Finding]:
    """Flag FSDP (FSDP1) computing in float16 next to an enabled GradScaler that is not a ShardedGradScaler.

    FSDP2 (``fully_shard``) is left alone on a torch whose DTensor all-reduces ``found_inf``; see
    ``ampdoctor._torch.distributed.dtensor_reduces_found_inf``.

    >>> list(fsdp_fp16_with_plain_scaler(TrainingSetup(torch.nn.Linear(2, 2), scaler=torch.amp.GradScaler("cpu"))))
    []
    """
    if not plain_scaler_enabled(setup):
        return
    synced = dtensor_reduces_found_inf()
    units = [u for u in fsdp_units(setup) if u.param_dtype == torch.float16 and not (u.fsdp2 and synced)]
    if not units:
        return
    yield rule.finding(
        units[0].name,
        f"{counted(len(units), 'FSDP unit')} compute{'s' if len(units) == 1 else ''} in float16 ({units[0].policy}): "
        f"{listing([u.name for u in units], 5)}; "
        f"the scaler is {scaler_label(setup.scaler)}, not a ShardedGradScaler. Each rank checks only its own "
        "gradient shard for inf, so ranks can disagree on skipping a step and their loss scales drift apart (and "
        "with keep_low_precision_grads=True it refuses the fp16 gradients outright).",
    )
