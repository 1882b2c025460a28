"""The per-rule explainers of a crash: each names what the traceback and the real objects show for one rule.

A rule without an explainer here, or whose explainer finds nothing, gets `_generic`: the rule, where it was raised
and the first line of the message.
"""

from __future__ import annotations

import re
from types import FrameType

import torch
from torch import nn

from ampdoctor._compat.loss_scalers import loss_scaler_shape
from ampdoctor._torch.frames import frame_values
from ampdoctor._torch.scaler import live_scale, optimizer_state
from ampdoctor.core.catalog import Rule, get_rule
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.findings import Finding
from ampdoctor.core.host_reads import to_host
from ampdoctor.core.names import listing, module_label
from ampdoctor.core.training import ParamInfo, TrainingSetup, group_by_module
from ampdoctor.core.words import scale_text
from ampdoctor.explanations.autocast_scope import autocast_scope
from ampdoctor.explanations.culprits import fp16_culprits, half_param_findings, no_grad_findings
from ampdoctor.explanations.fixes import UNKNOWN, minimum_scale_fix, nonfinite_grads_fix
from ampdoctor.explanations.reader import _Crash


def _generic(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    where = crash.site
    if crash.optimizer is not None:
        where = f"{setup.optimizer_label(crash.optimizer)} at {crash.site}"
    message = str(crash.exc).strip().splitlines()
    return [rule.finding(where, (message[0] if message else type(crash.exc).__name__)[:300], step)]


def _amp101(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    return fp16_culprits(setup, crash.optimizer, crash.param, step)


def _amp102(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    return half_param_findings(setup, torch.bfloat16, rule.code, crash.optimizer, crash.param, step)


def _amp204(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    opt = crash.optimizer
    where = setup.optimizer_label(opt) if opt is not None else crash.site
    return [rule.finding(where, f"scaler.step(..., closure=...) at {crash.site} with an enabled GradScaler; "
                    "a closure re-evaluates the loss, which loss scaling does not support", step)]


def unscale_twice(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    where = setup.optimizer_label(crash.optimizer) if crash.optimizer is not None else crash.site
    tell = ("without a ScalerGuard's history both causes fit; AMP401 if unscale_ (or clipping) runs on every "
            "micro-batch, with backward passes in between and no scaler.step(); AMP402 if an earlier iteration "
            "called unscale_ and then skipped both scaler.step() and scaler.update() (a grad-norm guard with "
            "`continue`). Attach ampdoctor.ScalerGuard(scaler, setup) to tell them apart")
    return [get_rule(code).finding(where, f"unscale_() raised at {crash.site}; {tell}", step)
            for code in ("AMP401", "AMP402") if code == rule.code]


def _amp404(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    label = setup.optimizer_label(crash.optimizer) if crash.optimizer is not None else "the optimizer"
    where = label if crash.optimizer is not None else crash.site
    return [rule.finding(where, f"scaler.step({label}) at {crash.site} is its second step since the last "
                    "scaler.update(): no update() completed between the two steps; call scaler.update() after "
                    "every scaler.step(), or sum the losses and step once", step)]


def _amp405(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    m = re.search(r"Attempted (\w+) but", str(crash.exc))
    call = m.group(1) if m else "a GradScaler method"
    where = setup.optimizer_label(crash.optimizer) if crash.optimizer is not None else crash.site
    return [rule.finding(where, f"scaler.{call}() at {crash.site} ran before any scaler.scale(loss): "
                    "backward() ran on the unscaled loss (or the first call after a resume was unscale_)", step)]


def _amp406(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    optimizers = [crash.optimizer] if crash.optimizer is not None else setup.optimizers
    return [f for opt in optimizers for f in no_grad_findings(opt, setup, step)]


def _amp410(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    if "empty" in str(crash.exc):
        detail = (f"scaler.load_state_dict({{}}) at {crash.site}: the checkpoint holds no scaler state (saved from "
                  "a disabled GradScaler, or the key was never filled), so the loss scale restarts at its initial "
                  "value")
    else:
        detail = (f"the GradScaler was pickled at {crash.site} between step() and update(); save "
                  "scaler.state_dict() after scaler.update() instead")
    return [rule.finding("GradScaler", detail, step)]


def _amp501(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    names: dict[int, str] = {}
    for model, prefix in zip(setup.models, setup.prefixes):
        for name, module in model.named_modules():
            names.setdefault(id(module), module_label(name, prefix))
    scope = autocast_scope(crash.exc.__traceback__)
    if crash.modules:
        module, frame = crash.modules[0]
        if scope is None and setup.autocast_dtype is not None and any(
                module is sub for m in setup.models for sub in m.modules()):   # the Doctor saw its forward
            scope = f"under torch.autocast(dtype=torch.{dtype_name(setup.autocast_dtype)}) (its model's forward)"
        name = names.get(id(module)) or crash.variable_name(module) or type(module).__name__
        params = {n: dtype_name(p) for n, p in module.named_parameters(recurse=False)}
        own = {id(p) for p in module.parameters(recurse=False)}
        inputs = [f"{k} {dtype_name(v)} {list(v.shape)}" for k, v in _frame_tensors(frame) if id(v) not in own]
        param_dtypes = sorted(set(params.values()))
        detail = (f"{type(module).__name__} with parameters "
                  f"{', '.join(f'{n} {d}' for n, d in params.items()) or '(none)'}"
                  f" got {', '.join(inputs) or 'inputs of another dtype'}")
        cast = param_dtypes[0] if len(param_dtypes) == 1 else None
        return [rule.finding(f"{name} ({type(module).__name__})", detail + _why_and_fix(crash, scope, cast),
                        step)]
    frame = crash.user_frames[0] if crash.user_frames else None
    tensors = [f"{k} {dtype_name(v)} {list(v.shape)}" for k, v in _frame_tensors(frame)] if frame else []
    if scope is not None:
        detail = f"tensors of different dtypes met in an op that autocast does not cast, {scope}"
    else:
        detail = "tensors of different dtypes met in one op (no torch.autocast block was seen around it)"
    if tensors:
        detail += f"; tensors in that frame: {listing(tensors)}"
    return [rule.finding(crash.site, detail, step)]


def _why_and_fix(crash: _Crash, scope: str | None, cast: str | None) -> str:
    """Say why a module's half parameters met another dtype, and the fix that applies there."""
    into_input = f", or cast its input to them: x.to(torch.{cast})" if cast else ""
    keep_fp32 = ("keep the parameters fp32 (model.float(); transformers: from_pretrained(..., "
                 "torch_dtype=torch.float32)) and let autocast pick each op's dtype")
    why = ""
    if "mixed dtype (CPU)" in str(crash.exc):   # ATen's CPU norm kernels: half input + fp32 params only
        why = ("; on CPU this norm takes a half input with float32 parameters, but half parameters only with an "
               "input of their own dtype")
    if scope is not None:
        if why:
            why += " (CPU autocast does not cast layer_norm; CUDA autocast runs it in fp32)"
        else:
            why = ", and autocast does not cast this op's inputs"
        return f"; the call ran {scope}{why}; {keep_fp32}{into_input}"
    return (f"{why}; no torch.autocast block was seen around the call: run the forward under "
            f"torch.autocast(device_type, dtype=torch.float16) with fp32 parameters (model.float()){into_input}")


def _frame_tensors(frame: FrameType) -> list[tuple[str, torch.Tensor]]:
    out = []
    for key, value in frame_values(frame):
        values = value if isinstance(value, (tuple, list)) else (value,)
        for i, v in enumerate(values[:8]):
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                out.append((key if len(values) == 1 and v is value else f"{key}[{i}]", v))
    return out[:8]


# the texts with which a library's loss scaler stops the run at its minimum scale, by library
_AT_MINIMUM = {"Minimum loss scale reached": "fairseq", "Current loss scale already at minimum": "DeepSpeed"}


def _amp603(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    """A library's loss scaler stopped the run at its minimum scale: name it, its scale and minimum where it shows
    them, what that means, and its library's fix."""
    text = str(crash.exc)
    family = next((f for said, f in _AT_MINIMUM.items() if said in text), None)
    if family is None:
        return []
    scaler = crash.loss_scaler
    shape = loss_scaler_shape(scaler) if scaler is not None else None
    where = f"{shape.label(scaler)} at {crash.site}" if shape is not None else crash.site
    lowest, scale = (shape.lowest(scaler), shape.scale(scaler)) if shape is not None else (None, None)
    said = [scale_text(lowest) if lowest is not None else "",
            f"the last scale tried: {scale_text(scale)}" if isinstance(scale, float) else ""]
    numbers = f" ({'; '.join(n for n in said if n)})" if any(said) else ""
    detail = (f"{family}'s loss scaler stopped the run: its loss scale reached its minimum{numbers}, halved on step "
              "after step whose gradients were inf/NaN. No smaller scale fixes an overflow in the forward pass or a "
              "loss that explodes (a learning rate too high)")
    return [rule.finding(where, detail, step, fix=minimum_scale_fix(family))]


def _amp608(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    if not crash.clip_params:
        return []
    graded = [p for p in crash.clip_params if isinstance(p, torch.Tensor) and p.grad is not None]
    with torch.no_grad():
        flags = [torch.isfinite(p.grad).all() for p in graded]
        flags = [f.full_tensor() if hasattr(f, "full_tensor") else f for f in flags]   # a DTensor's, as bool() reads
        # one read: the flags gathered on the first one's device
        finite = to_host(torch.stack([f.to(flags[0].device) for f in flags]), "explanations") if flags else []
    bad = [setup.info(p) or ParamInfo(setup.describe(p), "(not in the model)", p)
           for p, ok in zip(graded, finite) if not ok]
    scaled = ""
    if setup.scaler_enabled:
        ready = [o for o in setup.optimizers if not optimizer_state(setup.scaler, o)]
        if ready and live_scale(setup.scaler) is not None:
            scaled = "; the gradients were still scaled (clip before scaler.unscale_: AMP408)"
    modules = list(group_by_module(bad))   # one finding for the one clip call, not one per module
    if not modules:
        return []
    where = modules[0] if len(modules) == 1 else f"{len(modules)} modules ({', '.join(modules[:3])}" + (
        ", …)" if len(modules) > 3 else ")")
    trainable = [dtype_name(p.dtype) for p in setup.trainable()]
    autocast = dtype_name(setup.autocast_dtype) if setup.autocast_dtype is not None else UNKNOWN
    if setup.scaler_enabled:
        tell = "; let scaler.step() skip the step instead of raising (no error_if_nonfinite)"
    else:
        tell = "; no enabled GradScaler skips a step on them: skip it when the norm is not finite"
    return [rule.finding(where, f"non-finite gradients: {listing([p.name for p in bad])}{scaled}{tell}", step,
                         fix=nonfinite_grads_fix(setup.scaler_enabled, trainable, autocast))]


_EXPLAINERS = {
    "AMP101": _amp101,
    "AMP102": _amp102,
    "AMP204": _amp204,
    "AMP401": unscale_twice,
    "AMP402": unscale_twice,
    "AMP404": _amp404,
    "AMP405": _amp405,
    "AMP406": _amp406,
    "AMP410": _amp410,
    "AMP501": _amp501,
    "AMP603": _amp603,
    "AMP608": _amp608,
}
