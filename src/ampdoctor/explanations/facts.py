"""Say what ampdoctor holds when a crash matches no rule: the optimizers, the gradients, autocast and the scaler.

No rule explains such a crash, so nothing here is a diagnosis: each fact is read from the real objects (or, for
autocast, from where the traceback's frames were), and a fact that cannot be read is left out, never guessed.

>>> import torch
>>> from ampdoctor.core.training import TrainingSetup
>>> model = torch.nn.Linear(2, 2)
>>> crash_facts(ValueError("x"), TrainingSetup(model, torch.optim.SGD(model.parameters(), lr=0.1)))[0]
'optimizer[0] (SGD) steps 2 float32 tensors'
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ampdoctor._torch.scaler import is_enabled, live_scale, scaler_device
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.host_reads import to_host
from ampdoctor.core.names import listing
from ampdoctor.core.training import TrainingSetup
from ampdoctor.core.words import word_for
from ampdoctor.explanations.autocast_scope import autocast_scope

__all__ = ["crash_facts"]


def crash_facts(exc: BaseException, setup: TrainingSetup | None, scaler: Any = None) -> list[str]:
    """Return short sentences of what the run held at ``exc``: each optimizer and its tensors' dtypes, the
    trainable tensors with no gradient (when a backward gave the others one), the autocast region the crash was
    raised in (or the one the forward was seen under) and the GradScaler's state (``scaler``, else the setup's).
    """
    if setup is None:
        return []
    facts = [_optimizer(setup, i, opt) for i, opt in enumerate(setup.optimizers)]
    facts += _no_grad(setup) + [_autocast(exc, setup), _scaler(scaler if scaler is not None else setup.scaler)]
    return [f for f in facts if f]


def _optimizer(setup: TrainingSetup, index: int, opt: torch.optim.Optimizer) -> str:
    counts = Counter(dtype_name(p.dtype) for g in opt.param_groups for p in g["params"])
    tensors = ", ".join(f"{n} {d}" for d, n in counts.most_common()) or "no"
    return f"{setup.optimizer_label(opt)} steps {tensors} {word_for(sum(counts.values()), 'tensor')}"


def _no_grad(setup: TrainingSetup) -> list[str]:
    """Name the trainable tensors without a ``.grad``, only when others have one (a backward ran): before the
    first backward, or after ``zero_grad()``, none has one and that says nothing."""
    trainable = setup.trainable()
    missing = [p.name for p in trainable if p.param.grad is None]
    if not missing or len(missing) == len(trainable):
        return []
    return [f"{len(missing)} of {len(trainable)} trainable tensors got no gradient: {listing(missing)}"]


def _autocast(exc: BaseException, setup: TrainingSetup) -> str:
    scope = autocast_scope(exc.__traceback__)
    if scope is not None:
        return f"raised {scope}"
    if setup.autocast_dtype is not None:   # seen at the model's first forward (ampdoctor run, callbacks)
        devices = sorted({p.param.device.type for p in setup.params}) or ["?"]
        return (f"no autocast block seen around the raise; the forward ran under autocast "
                f"({'/'.join(devices)}, {dtype_name(setup.autocast_dtype)})")
    return "no autocast seen (around the raise, nor at the forward)"


def _scaler(scaler: Any) -> str:
    if scaler is None:
        return "no GradScaler"
    label = f"{type(scaler).__name__}({scaler_device(scaler) or '?'!r})"
    if not is_enabled(scaler):
        return f"{label} is disabled"
    scale = live_scale(scaler)
    if scale is None:
        return f"{label} is enabled, before its first scale()"
    return f"{label} is enabled, scale {to_host(scale.detach().reshape(-1)[0], 'explanations'):g}"
