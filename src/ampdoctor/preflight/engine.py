"""Check a training setup before the first step: `check()` for users, `run_preflight()` for the other entry points."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

import ampdoctor.preflight.rules.config  # noqa: F401  (importing a rule module registers its checks)
import ampdoctor.preflight.rules.distributed  # noqa: F401
import ampdoctor.preflight.rules.params  # noqa: F401
import ampdoctor.preflight.rules.wiring  # noqa: F401
from ampdoctor._compat.engines import engine_family, unwrap_engine_optimizer
from ampdoctor.core import catalog
from ampdoctor.core.findings import Finding
from ampdoctor.core.isolation import internal_error_finding
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup
from ampdoctor.preflight.rules import CHECKS
from ampdoctor.preflight.rules.distributed import without_engines

AUTOCAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def run_preflight(setup: TrainingSetup, select: Iterable[str] = ("AMP",)) -> list[Finding]:
    """Run the pre-flight checks whose codes start with one of ``select`` and return their findings.

    A check that raises is reported as one ``AMP001`` finding naming the rule; the other checks still run, and
    nothing is raised to the caller. Models and optimizers that DeepSpeed, Megatron-LM or apex own are left out of
    every rule but AMP212, which says so: their fp32 flat partitions are not the model's parameters.

    >>> setup = TrainingSetup(torch.nn.Linear(4, 4).half(), scaler=torch.amp.GradScaler("cpu"))
    >>> [f.code for f in run_preflight(setup, select=["AMP1"])]
    ['AMP101']
    """
    findings: list[Finding] = []
    try:
        checked = without_engines(setup)
    except Exception as exc:  # looking for engines must not stop the rules
        findings.append(internal_error_finding(exc, "rule AMP212"))
        checked = setup
    for rule in catalog.select(select, phase="preflight"):
        fn = CHECKS.get(rule.code)
        if fn is None:
            continue
        try:
            findings.extend(fn(setup if rule.code == "AMP212" else checked))
        except Exception as exc:  # a broken check must not break the user's run
            findings.append(internal_error_finding(exc, f"rule {rule.code}"))
    return findings


def check(
    model: nn.Module | Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    *,
    autocast_dtype: torch.dtype | None = None,
    accelerator: Any = None,
    select: str | Iterable[str] = ("AMP",),
) -> Report:
    """Check a model, its optimizers and its GradScaler for mixed-precision mistakes before training.

    Only metadata is read (dtypes, shapes, ``requires_grad``, optimizer groups), so this is fast, changes nothing
    and also works on a model on the ``meta`` device.

    Args:
        model: the module that is trained, or a list of them.
        optimizer: its optimizer, or a list of them. Without one, the optimizer rules (AMP104, AMP105, AMP204,
            AMP3xx) have nothing to look at. An engine's optimizer (DeepSpeed's ``DeepSpeedZeroOptimizer``,
            Megatron-LM's ``MixedPrecisionOptimizer``, apex's ``FP16_Optimizer``) is accepted and reported as AMP212.
        scaler: the ``torch.amp.GradScaler`` (or ``ShardedGradScaler``); taken from ``accelerator.scaler`` when not
            given.
        autocast_dtype: the dtype of the forward's ``torch.autocast``; taken from an accelerator that autocasts when
            not given. ``torch.float32`` means no autocast.
        accelerator: an ``accelerate.Accelerator``, if the loop uses one.
        select: code prefixes of the rules to run, e.g. ``"AMP1"`` or ``["AMP101", "AMP3"]``.

    Returns:
        A report whose ``findings`` are in catalog order; ``report.ok`` is True when there is nothing to fix.

    Raises:
        TypeError: an argument is not the kind of object expected (a string or a state_dict for ``model``, a
            parameter list for ``optimizer``...).
        ValueError: the model has no parameters, or ``select`` or ``autocast_dtype`` names nothing known.

    >>> model = torch.nn.Linear(4, 4).half()
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> check(model, opt, torch.amp.GradScaler("cpu"), autocast_dtype=torch.float16).codes()
    ['AMP101']
    """
    models = _models(model)
    engines, optimizer = _engine_optimizers(optimizer)
    optimizers = _optimizers(optimizer)
    if accelerator is not None and not hasattr(accelerator, "mixed_precision"):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}: "
                        f"{accelerator!r:.80}; pass the Accelerator object or leave it out")
    scaler = _scaler(scaler if scaler is not None else getattr(accelerator, "scaler", None))
    autocast_dtype = _autocast_dtype(autocast_dtype, accelerator)
    prefixes = _select(select)
    setup = TrainingSetup(models, optimizers, scaler, autocast_dtype, accelerator,
                          engines=engines)
    if not setup.params:
        names = ", ".join(type(m).__name__ for m in models)
        raise ValueError(f"model has no parameters ({names}); pass the module that is trained, not an empty "
                         "container or a wrapper that holds no weights")
    report = Report()
    for finding in run_preflight(setup, prefixes):
        report.add(finding)
    return report


def _models(value: Any) -> list[nn.Module]:
    if isinstance(value, nn.Module):
        return [value]
    if isinstance(value, Mapping):
        tensors = sum(isinstance(v, torch.Tensor) for v in value.values())
        if tensors:
            raise TypeError(f"model is a state_dict ({type(value).__name__} of {tensors} tensors), not a module; "
                            "build the model, call model.load_state_dict(state_dict), then pass the model")
        raise TypeError(f"model must be an nn.Module or a list of them, got {type(value).__name__}: {value!r:.80}; "
                        "pass the module you train")
    if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__"):
        raise TypeError(f"model must be an nn.Module, got {type(value).__name__} {value!r:.80}; load it first, e.g. "
                        "AutoModel.from_pretrained(path), and pass the module")
    if isinstance(value, torch.Tensor):
        raise TypeError(f"model must be an nn.Module, got a {type(value).__name__} of shape {list(value.shape)}; "
                        "pass the module that owns it")
    if isinstance(value, Iterator):
        raise TypeError(f"model must be an nn.Module, got a {type(value).__name__} (an iterator, e.g. "
                        "model.parameters()); pass the module itself")
    if isinstance(value, (list, tuple)):
        return _module_list(value)
    raise TypeError(f"model must be an nn.Module or a list of them, got {type(value).__name__}: {value!r:.80}; "
                    "pass the module you train")


def _module_list(value: list | tuple) -> list[nn.Module]:
    """Return a list of models as a list, after checking that it holds modules and only modules."""
    if not value:
        raise ValueError("model is an empty list; pass the module that is trained")
    for index, item in enumerate(value):
        if not isinstance(item, nn.Module):
            raise TypeError(f"model[{index}] must be an nn.Module, got {type(item).__name__}: {item!r:.80}; "
                            "pass modules only")
    return list(value)


def _engine_optimizers(value: Any) -> tuple[list[Any], Any]:
    """Split engine optimizers (DeepSpeed, Megatron-LM, apex) off ``value``, each replaced by its torch optimizer."""
    items = value if isinstance(value, (list, tuple)) else [value]
    engines = [o for o in items if o is not None and not isinstance(o, torch.optim.Optimizer) and engine_family(o)]
    if not engines:
        return [], value
    inner = [unwrap_engine_optimizer(o) if any(o is e for e in engines) else o for o in items]
    return engines, [o for o in inner if o is not None]


def _optimizers(value: Any) -> list[torch.optim.Optimizer]:
    if value is None:
        return []
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    how = "pass the optimizer object, e.g. check(model, torch.optim.AdamW(model.parameters()))"
    if isinstance(value, type):
        raise TypeError(f"optimizer must be an optimizer instance, got the class {value.__name__}; {how}")
    if isinstance(value, (list, tuple)) and all(isinstance(v, torch.optim.Optimizer) for v in value):
        return list(value)
    if isinstance(value, (list, tuple)):
        bad = next(v for v in value if not isinstance(v, torch.optim.Optimizer))
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a list of them, got a {type(value).__name__} "
                        f"holding {type(bad).__name__}; {how}")
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(value).__name__}: {value!r:.80}; {how}")


def _scaler(value: Any) -> Any:
    if value is None or isinstance(value, torch.amp.GradScaler):
        return value
    raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(value).__name__}: {value!r:.80}; pass the "
                    "scaler object, e.g. torch.amp.GradScaler('cpu'), or leave it out")


def _autocast_dtype(value: Any, accelerator: Any) -> torch.dtype | None:
    if value is None:
        if accelerator is not None and getattr(accelerator, "native_amp", False):
            # what accelerate's autocast context uses: fp16 for "fp16", bf16 for "bf16" (and fp8)
            return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(accelerator.mixed_precision))
        return None
    if not isinstance(value, torch.dtype):
        raise TypeError(f"autocast_dtype must be a torch.dtype, got {type(value).__name__}: {value!r:.80}; pass "
                        "torch.float16 or torch.bfloat16 (the dtype given to torch.autocast)")
    if value not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast_dtype={value!r} is not an autocast dtype; pass torch.float16 or torch.bfloat16, "
                         "or torch.float32 / None when there is no autocast")
    return None if value == torch.float32 else value


def _select(value: Any) -> tuple[str, ...]:
    prefixes = (value,) if isinstance(value, str) else value
    try:
        prefixes = tuple(prefixes)
    except TypeError:
        raise TypeError(f"select must be a code prefix or a list of them, got {type(value).__name__}: {value!r:.80}; "
                        "pass e.g. 'AMP1' or ['AMP101', 'AMP3']") from None
    for prefix in prefixes:
        if not isinstance(prefix, str):
            raise TypeError(f"select must hold strings, got {type(prefix).__name__}: {prefix!r:.80}; pass e.g. 'AMP1'")
        if not catalog.select([prefix]):
            raise ValueError(f"select={prefix!r} matches no rule; pass code prefixes such as 'AMP1' or 'AMP101' "
                             "(see `ampdoctor rules`)")
    return prefixes
