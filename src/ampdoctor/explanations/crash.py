"""Explain a crash or a pasted error with the catalog: which rule, and which parameters or modules are at fault.

Matching uses the ``errors`` patterns of the catalog rules, so a crash explanation and a pre-flight finding share
one source of truth. Nothing here runs before a failure: the culprits are read from the exception's traceback
frames (the ``GradScaler``, optimizer and module that were executing) and from the real objects.

>>> [r.code for r in explain_text("ValueError: Attempting to unscale FP16 gradients.")]
['AMP101']
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import sys
import traceback
from collections import deque
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
from torch import nn

from ampdoctor.core.callsite import is_user_file
from ampdoctor.core.catalog import Rule, get_rule, rules_for_error
from ampdoctor.core.findings import Finding
from ampdoctor.core.training import ParamInfo, TrainingSetup, group_by_module

if TYPE_CHECKING:
    from ampdoctor.guard.scaler_guard import ScalerGuard

__all__ = ["explain", "explain_exception", "explain_text"]

_MAX_NAMES = 10          # names listed in one finding
_STATE_MACHINE = {"AMP401", "AMP402", "AMP403", "AMP404", "AMP405", "AMP406", "AMP407"}
_SAME_TEXT = {"AMP401": "AMP402", "AMP402": "AMP401"}   # one torch message, two causes


def explain(error: BaseException | str, setup: TrainingSetup | None = None,
            guard: "ScalerGuard | None" = None) -> list[Finding] | list[Rule]:
    """Explain an exception (returns findings) or a pasted error text, code or rule name (returns rules).

    >>> [r.code for r in explain("AMP404")]
    ['AMP404']
    """
    if isinstance(error, BaseException):
        return explain_exception(error, setup, guard)
    if isinstance(error, str):
        return explain_text(error)
    raise TypeError(f"explain() takes an exception or a str, got {type(error).__name__}: {error!r:.80}")


# ---- text -> rules --------------------------------------------------------------------------------------------

def explain_text(text: str) -> list[Rule]:
    """Return the catalog rules that explain a pasted error or traceback, or that a code or name refers to.

    Any size is accepted; only the last 200 KB are read and the work per pattern is capped.

    >>> [r.code for r in explain_text("fp16-trainable-params")]
    ['AMP101']
    >>> explain_text("all good")
    []
    """
    if not isinstance(text, str):
        raise TypeError(f"explain_text() takes a str, got {type(text).__name__}: {text!r:.80}")
    named = _rules_named(text)
    return named if named is not None else match_rules(text)


def _rules_named(text: str) -> list[Rule] | None:
    tokens = text.replace(",", " ").split() if len(text) <= 400 else []
    if not tokens:
        return None
    rules = []
    for token in tokens:
        try:
            rules.append(get_rule(token))
        except KeyError:
            return None
    return list(dict.fromkeys(rules))


def match_rules(text: str) -> list[Rule]:
    """Return the rules whose error patterns occur in ``text``, in catalog order, with bounded work.

    >>> [r.code for r in match_rules("RuntimeError: step() has already been called since the last update().")]
    ['AMP404']
    """
    return rules_for_error(text)


# ---- exception -> findings --------------------------------------------------------------------------------------

@dataclass
class _Crash:
    """What the traceback of one exception shows: the objects that were executing when it was raised."""

    exc: BaseException
    scaler: Any = None
    optimizer: torch.optim.Optimizer | None = None
    param: torch.Tensor | None = None                        # `_unscale_grads_`'s loop variable
    modules: list[tuple[nn.Module, FrameType]] = field(default_factory=list)   # innermost first
    clip_params: list[torch.Tensor] | None = None
    user_frames: list[FrameType] = field(default_factory=list)                 # innermost first

    @classmethod
    def of(cls, exc: BaseException) -> "_Crash":
        crash = cls(exc)
        frames: deque[FrameType] = deque(maxlen=400)
        tb = exc.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):
            f_locals = frame.f_locals
            owner = f_locals.get("self")
            filename = frame.f_code.co_filename
            if isinstance(owner, torch.amp.GradScaler):
                crash.scaler = crash.scaler or owner
                opt = f_locals.get("optimizer")
                if crash.optimizer is None and isinstance(opt, torch.optim.Optimizer):
                    crash.optimizer = opt
                if crash.param is None and isinstance(f_locals.get("param"), torch.Tensor):
                    crash.param = f_locals["param"]
            elif isinstance(owner, nn.Module):
                crash.modules.append((owner, frame))
            if frame.f_code.co_name == "clip_grad_norm_" and isinstance(f_locals.get("parameters"), list):
                crash.clip_params = crash.clip_params or f_locals["parameters"]
            if is_user_file(filename):
                crash.user_frames.append(frame)
        # The frames that called explain (e.g. the loop that caught the error) hold the model too.
        caller = sys._getframe(1)
        for _ in range(20):
            if caller is None:
                break
            if is_user_file(caller.f_code.co_filename):
                crash.user_frames.append(caller)
            caller = caller.f_back
        return crash

    @property
    def site(self) -> str:
        """``file:line`` of the innermost frame outside torch and ampdoctor."""
        tb, site = self.exc.__traceback__, "<unknown>"
        while tb is not None:
            if is_user_file(tb.tb_frame.f_code.co_filename):
                site = f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
            tb = tb.tb_next
        return site

    def user_locals(self) -> Iterable[tuple[str, Any]]:
        for frame in self.user_frames:
            yield from list(frame.f_locals.items())

    def guess_setup(self) -> TrainingSetup:
        """Build a setup from the models, optimizers and scaler found in the user's frames."""
        modules: dict[int, nn.Module] = {}
        optimizers: dict[int, torch.optim.Optimizer] = {}
        scaler = self.scaler
        for _, value in self.user_locals():
            if isinstance(value, nn.Module):
                modules.setdefault(id(value), value)
            elif isinstance(value, torch.optim.Optimizer):
                optimizers.setdefault(id(value), value)
            elif scaler is None and isinstance(value, torch.amp.GradScaler):
                scaler = value
        if self.optimizer is not None:
            optimizers.setdefault(id(self.optimizer), self.optimizer)
        nested = {id(sub) for m in modules.values() for sub in m.modules() if sub is not m}
        roots = [m for k, m in modules.items() if k not in nested]
        if len(roots) > 1:   # keep the models involved in the crash
            involved = {id(m) for m, _ in self.modules}
            tensors = {id(t) for t in self.clip_params or ()}
            tensors |= {id(p) for o in optimizers.values() for g in o.param_groups for p in g["params"]}
            roots = [m for m in roots if any(id(sub) in involved for sub in m.modules())
                     or any(id(p) in tensors for p in m.parameters())] or roots
        return TrainingSetup(roots, list(optimizers.values()), scaler)

    def variable_name(self, obj: Any) -> str | None:
        for name, value in self.user_locals():
            if value is obj and not name.startswith("."):
                return name
        return None


def explain_exception(exc: BaseException, setup: TrainingSetup | None = None,
                      guard: "ScalerGuard | None" = None) -> list[Finding]:
    """Return findings that explain ``exc``, naming the parameters, modules or calls at fault.

    The exception is only read: it is never wrapped, changed or re-raised. With a ``ScalerGuard`` that watched
    the run, GradScaler state-machine errors are explained from its history.

    >>> try:
    ...     torch.amp.GradScaler("cpu").load_state_dict({})
    ... except RuntimeError as e:
    ...     [f.code for f in explain_exception(e)]
    ['AMP410']
    """
    rules = match_rules("\n".join(_messages(exc)))
    if not rules:
        rules = match_rules("".join(traceback.format_exception(exc)))
    if not rules:
        return []
    crash = _Crash.of(exc)
    if guard is not None and guard.broken:   # its history is not to be trusted any more
        setup, guard = setup or guard.setup, None
    if setup is None:
        setup = guard.setup if guard is not None else crash.guess_setup()
    setup = with_scaler(setup, crash.scaler or (guard.scaler if guard is not None else None))
    step = guard.iteration if guard is not None else None

    findings: list[Finding] = []
    handled: set[str] = set()
    codes = {r.code for r in rules}
    if guard is not None:   # the state machine is explained from the guard's history
        for f in guard.crash_findings():
            if f.code in codes and f.code in _STATE_MACHINE:
                findings.append(f)
                handled |= {f.code, _SAME_TEXT.get(f.code, f.code)}
    for rule in rules:
        if rule.code in handled:
            continue
        produced = [] if rule.code in _STATE_MACHINE else _from_check(rule.code, setup, step)
        if not produced:
            explainer = _EXPLAINERS.get(rule.code, _generic)
            produced = explainer(rule, crash, setup, step)
        findings.extend(produced or _generic(rule, crash, setup, step))
    return findings


def with_scaler(setup: TrainingSetup, scaler: Any) -> TrainingSetup:
    """Return ``setup``, or a copy that includes ``scaler`` when it has none (checks may need it)."""
    if scaler is None or setup.scaler is not None:
        return setup
    return TrainingSetup(setup.models, setup.optimizers, scaler, setup.autocast_dtype, setup.accelerator)


def _messages(exc: BaseException) -> list[str]:
    """Return ``Type: message`` for ``exc`` and the exceptions it was raised from, each cut to 20,000 characters."""
    out, seen, current = [], set(), exc
    while current is not None and id(current) not in seen and len(out) < 8:
        seen.add(id(current))
        try:
            message = str(current)
        except Exception:  # a broken __str__ must not stop the explanation
            message = object.__repr__(current)
        out.append(f"{type(current).__name__}: {message[:20_000]}")
        current = current.__cause__ or current.__context__
    return out


_LOADED_CHECKS = False


def _from_check(code: str, setup: TrainingSetup, step: int | None = None) -> list[Finding]:
    """Run the pre-flight check of ``code``, if one is registered, to name the culprits."""
    global _LOADED_CHECKS
    from ampdoctor.preflight import rules as rules_pkg

    if not _LOADED_CHECKS:
        _LOADED_CHECKS = True
        for module in pkgutil.iter_modules(rules_pkg.__path__):
            try:
                importlib.import_module(f"{rules_pkg.__name__}.{module.name}")
            except Exception:   # another rule module's bug must not hide this explanation
                pass
    check = rules_pkg.CHECKS.get(code)
    if check is None:
        return []
    try:
        return [replace(f, step=step) for f in check(setup) if f.code == code]
    except Exception:   # a broken check must not hide the explanation
        return []


def finding(code: str, where: str, detail: str, step: int | None = None) -> Finding:
    """Return a finding of catalog rule ``code`` with the rule's severity."""
    return Finding(code, get_rule(code).severity, where, detail, step)


def _dtype(t: torch.Tensor | torch.dtype) -> str:
    return str(t if isinstance(t, torch.dtype) else t.dtype).removeprefix("torch.")


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_NAMES])
    return shown + (f" and {len(items) - _MAX_NAMES} more" if len(items) > _MAX_NAMES else "")


def optimizer_label(optimizer: Any, setup: TrainingSetup) -> str:
    """Return ``optimizer[0] (AdamW)``, numbered as in ``setup.optimizers``."""
    for i, opt in enumerate(setup.optimizers):
        if opt is optimizer:
            return f"optimizer[{i}] ({type(optimizer).__name__})"
    return f"optimizer ({type(optimizer).__name__})"


def _tensor_name(t: torch.Tensor, setup: TrainingSetup, optimizer: Any = None) -> str:
    info = setup.info(t)
    if info is not None:
        return info.describe()
    where = "not in the model"
    if optimizer is not None:
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if p is t:
                    where = f"param_groups[{gi}]['params'][{pi}]"
    return f"{where} ({_dtype(t)}, {list(t.shape)})"


# ---- culprits, shared with ScalerGuard --------------------------------------------------------------------------

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
        detail = f"trainable {_dtype(dtype)} parameters: {_names([p.describe() for p in params])}"
        if culprit is not None and culprit in params:
            detail += f"; GradScaler raised on {culprit.name}"
        findings.append(finding(code, module, detail, step))
    if not findings and optimizer is not None:
        loose = [p for g in optimizer.param_groups for p in g["params"]
                 if isinstance(p, torch.Tensor) and p.requires_grad and p.dtype == dtype]
        if loose:
            findings.append(finding(code, optimizer_label(optimizer, setup),
                                    f"trainable {_dtype(dtype)} tensors: "
                                    f"{_names([_tensor_name(p, setup, optimizer) for p in loose])}", step))
    return findings


def no_grad_findings(optimizer: Any, setup: TrainingSetup, step: int | None = None) -> list[Finding]:
    """Say, for each tensor of ``optimizer`` without a ``.grad``, why it got none (AMP406, AMP301)."""
    label = optimizer_label(optimizer, setup)
    frozen: list[ParamInfo] = []
    unused: list[ParamInfo] = []
    foreign: list[str] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, torch.Tensor) or p.grad is not None:
                continue
            info = setup.info(p)
            if info is None and (p.requires_grad and setup.models):
                foreign.append(_tensor_name(p, setup, optimizer))
            elif info is None:
                frozen_or_unknown = ParamInfo(_tensor_name(p, setup, optimizer), label, p)
                (unused if p.requires_grad else frozen).append(frozen_or_unknown)
            else:
                (unused if p.requires_grad else frozen).append(info)
    findings = []
    for module, params in group_by_module(frozen).items():
        findings.append(finding("AMP406", module, f"{_names([p.name for p in params])}: frozen "
                                f"(requires_grad=False), so no gradient reaches {label}", step))
    for module, params in group_by_module(unused).items():
        why = ("requires_grad=True but .grad is None after backward: not used in the forward pass, or cut off by "
               "reentrant gradient checkpointing (use_reentrant=False)")
        if not setup.models:
            why += "; the model is unknown, so ampdoctor cannot tell whether these are its parameters"
        findings.append(finding("AMP406", module, f"{_names([p.name for p in params])}: {why}", step))
    if foreign:
        detail = (f"{len(foreign)} tensor(s) in {label} are not parameters of the model: {_names(foreign)}; "
                  "the optimizer was built over different tensors (before a move, cast, wrap or re-creation)")
        findings.append(finding("AMP406", label, detail, step))
        findings.extend(_from_check("AMP301", setup, step) or [finding("AMP301", label, detail, step)])
    return findings


# ---- per-rule explainers ------------------------------------------------------------------------------------------

def _generic(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    where = crash.site
    if crash.optimizer is not None:
        where = f"{optimizer_label(crash.optimizer, setup)} at {crash.site}"
    message = str(crash.exc).strip().splitlines()
    return [finding(rule.code, where, (message[0] if message else type(crash.exc).__name__)[:300], step)]


def _amp101(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    return fp16_culprits(setup, crash.optimizer, crash.param, step)


def _amp102(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    return half_param_findings(setup, torch.bfloat16, rule.code, crash.optimizer, crash.param, step)


def _amp204(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    opt = crash.optimizer
    where = optimizer_label(opt, setup) if opt is not None else crash.site
    return [finding(rule.code, where, f"scaler.step(..., closure=...) at {crash.site} with an enabled GradScaler; "
                    "a closure re-evaluates the loss, which loss scaling does not support", step)]


def _unscale_twice(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    where = optimizer_label(crash.optimizer, setup) if crash.optimizer is not None else crash.site
    tell = ("without a ScalerGuard's history both causes fit; AMP401 if unscale_ (or clipping) runs on every "
            "micro-batch, with backward passes in between and no scaler.step(); AMP402 if an earlier iteration "
            "called unscale_ and then skipped both scaler.step() and scaler.update() (a grad-norm guard with "
            "`continue`). Attach ampdoctor.ScalerGuard(scaler, setup) to tell them apart")
    return [finding(code, where, f"unscale_() raised at {crash.site}; {tell}", step)
            for code in ("AMP401", "AMP402") if code == rule.code]


def _amp405(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    m = re.search(r"Attempted (\w+) but", str(crash.exc))
    call = m.group(1) if m else "a GradScaler method"
    where = optimizer_label(crash.optimizer, setup) if crash.optimizer is not None else crash.site
    return [finding(rule.code, where, f"scaler.{call}() at {crash.site} ran before any scaler.scale(loss): "
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
    return [finding(rule.code, "GradScaler", detail, step)]


def _amp501(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    names: dict[int, str] = {}
    for index, model in enumerate(setup.models):
        prefix = "" if len(setup.models) == 1 else f"model{index}."
        for name, module in model.named_modules():
            names.setdefault(id(module), f"{prefix}{name}" if name else (prefix.rstrip(".") or "(root)"))
    if crash.modules:
        module, frame = crash.modules[0]
        name = names.get(id(module)) or crash.variable_name(module) or type(module).__name__
        params = {n: _dtype(p) for n, p in module.named_parameters(recurse=False)}
        own = {id(p) for p in module.parameters(recurse=False)}
        inputs = [f"{k} {_dtype(v)} {list(v.shape)}" for k, v in _frame_tensors(frame) if id(v) not in own]
        param_dtypes = sorted(set(params.values()))
        detail = (f"{type(module).__name__} with parameters "
                  f"{', '.join(f'{n} {d}' for n, d in params.items()) or '(none)'}"
                  f" got {', '.join(inputs) or 'inputs of another dtype'}")
        cast = param_dtypes[0] if len(param_dtypes) == 1 else None
        detail += ("; run the forward under torch.autocast(device_type, dtype=torch.float16)"
                   + (f" or cast the input: x.to(torch.{cast})" if cast else ""))
        return [finding(rule.code, f"{name} ({type(module).__name__})", detail, step)]
    frame = crash.user_frames[0] if crash.user_frames else None
    tensors = [f"{k} {_dtype(v)} {list(v.shape)}" for k, v in _frame_tensors(frame)] if frame else []
    detail = "tensors of different dtypes met outside torch.autocast"
    if tensors:
        detail += f"; tensors in that frame: {_names(tensors)}"
    return [finding(rule.code, crash.site, detail, step)]


def _frame_tensors(frame: FrameType) -> list[tuple[str, torch.Tensor]]:
    out = []
    for key, value in list(frame.f_locals.items()):
        values = value if isinstance(value, (tuple, list)) else (value,)
        for i, v in enumerate(values[:8]):
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                out.append((key if len(values) == 1 and v is value else f"{key}[{i}]", v))
    return out[:8]


def _amp608(rule: Rule, crash: _Crash, setup: TrainingSetup, step: int | None) -> list[Finding]:
    if not crash.clip_params:
        return []
    bad = []
    with torch.no_grad():
        for p in crash.clip_params:
            if isinstance(p, torch.Tensor) and p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                info = setup.info(p) or ParamInfo(_tensor_name(p, setup), "(not in the model)", p)
                bad.append(info)
    scaled = ""
    if setup.scaler_enabled:
        states = getattr(setup.scaler, "_per_optimizer_states", {})
        ready = [o for o in setup.optimizers if not states.get(id(o))]
        if ready and getattr(setup.scaler, "_scale", None) is not None:
            scaled = "; the gradients were still scaled (clip before scaler.unscale_: AMP408)"
    return [finding(rule.code, module, f"non-finite gradients: {_names([p.name for p in params])}{scaled}; "
                    "under fp16 let scaler.step() skip the step instead of raising", step)
            for module, params in group_by_module(bad).items()]


_EXPLAINERS = {
    "AMP101": _amp101,
    "AMP102": _amp102,
    "AMP204": _amp204,
    "AMP401": _unscale_twice,
    "AMP402": _unscale_twice,
    "AMP405": _amp405,
    "AMP406": _amp406,
    "AMP410": _amp410,
    "AMP501": _amp501,
    "AMP608": _amp608,
}
