"""Discovery for ``ampdoctor run``: find what a whole process trains through torch's global hooks.

`Doctor` discovers the models (modules run with grad enabled that are no part of a model running then: called by the
loop, or inside a loss module or wrapper that does not hold them), optimizers and GradScalers of a process without
any change to the training code, and hands them to the run's `ampdoctor.session.session.Session` before the
first update (and again for objects first seen later), which runs the pre-flight rules, the fix, the guard, the
watch and the crash explanation.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ampdoctor._compat.accelerate import accelerator_built
from ampdoctor._torch.frames import frame_values
from ampdoctor._torch.module_hooks import any_global_module_hook, silence_compile_hook_warning
from ampdoctor._torch.scaler import is_enabled
from ampdoctor.core.callsite import is_user_file
from ampdoctor.core.dtypes import HALF
from ampdoctor.core.findings import Finding
from ampdoctor.core.isolation import call_safely
from ampdoctor.core.names import script_bindings
from ampdoctor.core.options import RunOptions
from ampdoctor.core.patch import observe
from ampdoctor.core.training import TrainingSetup, optimizer_tensors, owns_any, unwrap_optimizer
from ampdoctor.monitor.watched import closure_calls_back
from ampdoctor.ranks.info import RankInfo, from_process_group
from ampdoctor.runner.discovery import (
    instances,
    internal_optimizers,
    live_optimizers,
    scaler_classes,
    scan,
    trained_models,
    unseen_tensors,
    unwrap_module,
)
from ampdoctor.session.frameworks import autocast_ahead, framework_autocast
from ampdoctor.session.run import terminated
from ampdoctor.session.session import Session
from ampdoctor.session.stages import Stages

_MAX_EARLY_SCANS = 3  # gc scans for optimizers from forward hooks before waiting for the first step
_MAX_SCANS = 64       # under --fix, scans for the optimizer of a model first seen after the start (folds)
_MAX_FAMILIES = 256   # models whose modules discovery remembers; more (modules built in a forward): start again


class Doctor:
    """Watch a training process; a context manager.

    Args:
        options: what the run was asked for (``core.options.RunOptions``): ``fix`` repairs what can be repaired
            (upcast trainable params under autocast, fp32 master weights for a half model without autocast) and
            re-applies when the script downcasts again; ``watch`` attaches ``ampdoctor.watch`` to the trained model
            once it is known (``every``, ``log_dir``, ``activations``).
        on_event: called with each human-readable event line (fixes applied, internal errors).
        on_rank: told once, when this process's rank is first read.
        stages: which objects the run trains now (``session.stages.Stages``); its ``ended`` optimizers and
            GradScalers (a notebook's earlier cells) discovery leaves out until they train again: something may still
            hold them (IPython keeps a crashed cell's traceback), but they are not what the process trains now.
        on_first_look: told once, at the first look at what the process trains (before its pre-flight).

    The lifecycle itself (pre-flight, fix, guard, watch, explanation, the end) is the `Session`'s; the Doctor finds
    what the process trains and hands it over.

    >>> with Doctor(RunOptions(watch=False)) as doctor:
    ...     pass
    >>> doctor.report.findings
    []
    """

    def __init__(self, options: RunOptions = RunOptions(), *, on_event: Callable[[str], None] | None = None,
                 on_rank: Callable[[RankInfo], None] | None = None, stages: Stages | None = None,
                 on_first_look: Callable[[], None] | None = None) -> None:
        self.fix = options.fix
        self.on_rank = on_rank or (lambda info: None)
        self.on_first_look = on_first_look
        self.session = Session(options, on_event=on_event, stages=stages)
        self.stages = self.session.stages
        self.report = self.session.report   # the launcher may replace it with the merge of its child processes'
        self.models: list[nn.Module] = []
        self._autocast: dict[int, torch.dtype | None] = {}
        self._depth = self._scans = self._in_scaler_step = 0
        self._handles: list[Any] = []
        self._forward_handles: list[Any] = []
        # The models whose forward runs now, with the depth it began at and the ids of their modules: a module called
        # inside one of them is its part, any other is a model (fairseq's criterion(model, sample) calls the model).
        self._roots: list[tuple[int, frozenset[int]]] = []
        self._families: dict[int, tuple[Any, frozenset[int]]] = {}   # by id: (weakref to the model, its modules)
        # Per optimizer that stepped: (weakref to it, what it trains that no model seen running holds, or None,
        # and how many models were seen when that was read). What is left at the end is the report's `unwatched`.
        self._unseen: dict[int, tuple[Any, dict[str, Any] | None, int]] = {}
        # The optimizers that stepped before any model was seen (held until the first look, at most to the end): a
        # step before any forward pass builds a checkpoint's state; a second one, the loop's, is looked at blind.
        self._stepped_unseen: list[Any] = []
        self._accelerator_found: Any = None
        self._attached = False
        self._internal: weakref.WeakSet = weakref.WeakSet()  # optimizers inside others' steps (ZeRO's own)
        # This process's rank, read from torch.distributed at the first look (the script may destroy its group
        # before the end); None outside a process group of several ranks.
        self.rank_info: RankInfo | None = None

    @property
    def setup(self) -> TrainingSetup | None:
        """The objects of the last look (None before the first and after the end)."""
        return self.session.setup

    @property
    def log_dir(self) -> str | None:
        return self.session.options.log_dir

    @log_dir.setter
    def log_dir(self, value: str | None) -> None:   # a child that turns out to be a rank: before the watch starts
        self.session.options = self.session.options.replace(log_dir=value)

    @property
    def failed_at(self) -> float | None:
        """When the script raised (``time.time()``), to order the ranks' crashes."""
        return self.session.failed_at

    # ---- attach / detach -------------------------------------------------------------------------------------
    def attach(self) -> "Doctor":
        if self._attached:
            return self
        self._attached = True
        self._hook_forwards()
        self._handles.append(register_optimizer_step_pre_hook(self._on_optimizer_step))
        for cls in scaler_classes():
            if "scale" in vars(cls):
                self._handles.append(observe(cls, "scale", before=self._on_scale,
                                             on_error=self.session.internal_error))
            if "step" in vars(cls):   # a skipped step never calls optimizer.step(): the stages follow this too
                self._handles.append(observe(cls, "step", before=self._on_scaler_step,
                                             finally_=self._left_scaler_step, on_error=self.session.internal_error))
        # Before the script's first line: names it binds at import (`from torch.nn.utils import clip_grad_norm_`)
        # are then the observed ones.
        self.session.observe_process(scaler_classes())
        if self.fix:
            self._handles.append(observe(torch.nn.parallel.DistributedDataParallel, "__init__",
                                         before=self._before_ddp, on_error=self.session.internal_error))
        return self

    def detach(self) -> None:
        if self.setup is None and self._stepped_unseen and not self.session.broken and not self.session.finished:
            # stepped, and never a model seen: the pre-flight still reads what the optimizers hold
            stepped = self._stepped_unseen
            call_safely(self._start, blind=True, at_end=True, on_error=self.session.internal_error)
            for optimizer in stepped:
                call_safely(self._note_unseen, optimizer, on_error=self.session.internal_error)
        unwatched = [entry for _, entry, _ in self._unseen.values() if entry is not None]
        if unwatched and not self.session.finished:
            self.session.report.extra["unwatched"] = unwatched
        self.session.finish()   # the watch, the guard, the repairs and the session's own observers
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        self._unhook_forwards()
        self._unseen, self._stepped_unseen = {}, []
        # Keep the report; drop every reference to the user's objects.
        self.models = []
        self._autocast = {}
        self._attached = False

    def __enter__(self) -> "Doctor":
        return self.attach()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            self.explain(exc)
        self.detach()

    # ---- discovery -------------------------------------------------------------------------------------------
    def _hook_forwards(self) -> None:
        """Register the global forward hooks that find the models (again where a look leaves a tensor unseen)."""
        if self._forward_handles:
            return
        # only ours: torch.compile would warn about them on every script (the filter goes when they go)
        quiet = [] if any_global_module_hook() else [silence_compile_hook_warning()]
        m = torch.nn.modules.module
        self._forward_handles = [
            m.register_module_forward_pre_hook(self._on_forward_pre),
            m.register_module_forward_hook(self._on_forward_post, always_call=True), *quiet]

    def _unhook_forwards(self) -> None:
        """Remove the global forward hooks. (Safe inside a forward hook: torch iterates over a copy of them.)"""
        for handle in self._forward_handles:
            handle.remove()
        self._forward_handles = []
        self._depth = 0   # this forward's post-hook is gone with them: the count would stay at 1
        self._roots, self._families = [], {}

    def _on_forward_pre(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self.session.broken or any(id(module) in family for _, family in self._roots):
            return   # a part of a model whose forward runs now
        family = call_safely(self._family, module, on_error=self.session.internal_error)
        if family:
            self._roots.append((self._depth, family))
        if not torch.is_grad_enabled():   # a frozen teacher, a VAE encoding the batch: its forward is looked at too
            call_safely(self._note_frozen, module, on_error=self.session.internal_error)
            return
        call_safely(self._on_root_forward, module, on_error=self.session.internal_error)  # never reach the forward

    def _on_forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._roots and self._roots[-1][0] == self._depth:
            self._roots.pop()
        self._depth = max(0, self._depth - 1)

    def _family(self, module: nn.Module) -> frozenset[int] | None:
        """Return the ids of ``module``'s modules (read once per model), or None when it holds no parameter: a loss
        module, a wrapper that holds the model in a closure; the modules it calls are looked at in turn."""
        cached = self._families.get(id(module))
        if cached is not None and cached[0]() is module:
            return cached[1]
        if next(module.parameters(), None) is None:
            return None
        if len(self._families) >= _MAX_FAMILIES:
            self._families = {}
        family = frozenset(id(m) for m in module.modules())
        self._families[id(module)] = (weakref.ref(module), family)
        return family

    def _on_root_forward(self, module: nn.Module) -> None:
        first = next(module.parameters(), None)
        if first is None:
            return
        new, looked = all(m is not module for m in self.models), self.setup is not None
        if new:
            if not any(p.requires_grad for p in module.parameters()):
                self._note_frozen(module)
                return
            self.models.append(module)
            self.session.seen["models"].add(id(unwrap_module(module)))   # DDP(model), compile(model): one model
        dtype = _autocast_dtype(first.device.type) or framework_autocast(module, self._framework_accelerator())
        self._autocast[id(module)] = dtype
        if self.setup is None and self._scans < _MAX_EARLY_SCANS:
            self._scans += 1
            if live_optimizers(instances(torch.optim.Optimizer), self.stages.ended) and not self._scaler_undecided():
                self._start()
        elif self.fix and self.setup is not None and not self.session.repairs.knows(module) \
                and self._scans < _MAX_SCANS:
            # A model not seen before (a new fold, a resumed copy): repair it before its backward, if an
            # optimizer trains it, so the GradScaler never sees its fp16 gradients.
            self._scans += 1
            if any(owns_any(o, module) for o in live_optimizers(instances(torch.optim.Optimizer), self.stages.ended)):
                self._start()
        if self.fix and self.setup is not None:
            self.session.reapply(self.setup, module, dtype)
        elif new and looked:
            self._follow_unseen()   # a model the last look had not seen run: it may be the last one

    def _note_frozen(self, module: nn.Module) -> None:
        if self.stages.note_frozen(module):   # the first time: its name in the user's frames (`vae.encoder`)
            self.session.names.note_part_name(module, _user_namespaces())

    def _scaler_undecided(self) -> bool:
        """Whether the stage's GradScaler shows only at its first ``scale()`` or step: an ended stage's enabled
        scaler is alive and no other (a notebook's scaler cell ran once, a re-run cell built a new optimizer). Its
        ``scale()`` makes it this stage's and starts the look with it; a step before any starts it without (AMP208).
        Not under --fix, whose repairs come before the first backward."""
        ended = [s for s in self.stages.ended if isinstance(s, scaler_classes()) and is_enabled(s)]
        return bool(ended) and not self.fix and not scan(self.stages.ended).scalers

    def _on_scale(self, scaler: Any, *args: Any, **kwargs: Any) -> None:
        self.session.seen["scalers"].add(id(scaler))
        self.stages.trains_again(scaler)   # an ended stage's scaler scales again: it is this stage's
        if self.setup is None and not self.session.broken and self._attached:
            # an optimizer stepped already, and no model was seen running: look at what the optimizers hold
            self._start(scaler, blind=bool(self._stepped_unseen))
            guard = self.session.guard
            if guard is not None and guard.scaler is scaler:
                self.session.scale_called(*args, **kwargs)   # the guard attached during this very call

    def _before_ddp(self, ddp: Any, module: Any = None, *args: Any, **kwargs: Any) -> None:
        """--fix under DDP (the script's own, or accelerate's ``prepare``): repair the bare model before the reducer
        builds its buckets, when the forward's autocast is already known (``frameworks.autocast_ahead``)."""
        module = kwargs.get("module", module)
        if self.session.broken or not isinstance(module, nn.Module) or self.session.repairs.knows(module) \
                or not any(p.requires_grad and p.dtype in HALF for p in module.parameters()):
            return
        live, accelerator = scan(self.stages.ended), _accelerator()   # two scans of the live objects, per DDP built
        dtype = autocast_ahead(accelerator, live.scalers)
        if dtype is None:
            return
        scaler = next((s for s in live.scalers if is_enabled(s)), None)
        setup = TrainingSetup([module], live.optimizers, scaler, dtype, accelerator, facts=self.session.observers.facts,
                              names=self.session.names)
        self.session.repair_before_wrap(setup, module, dtype)

    def _framework_accelerator(self) -> Any:
        if self._accelerator_found is None and "accelerate" in sys.modules:
            self._accelerator_found = _accelerator() or False   # one scan; False: looked, none
        return self._accelerator_found or None

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        real = unwrap_optimizer(optimizer)
        if real in self._internal:
            return None   # ZeRO's own per-rank optimizer, inside the step of the one the script calls
        self.stages.trains_again(real)   # an ended stage's optimizer steps again: it is this stage's
        self.session.seen["optimizers"].add(id(real))
        if not self._in_scaler_step:   # counted there
            self.session.optimizer_stepped(real)   # the watch follows what trains now (a resume, a second stage)
        self.session.confirm_wiring(real)   # its first step: the gradients are there now
        if self.session.broken:
            return None
        hooked = bool(self._forward_handles)   # since its last step: the forward pass of this one was visible
        if self.setup is None and not self.models:
            # step(closure) before any forward (Lightning, LBFGS): the forward runs in the closure, where the first
            # look attaches the watch after this step's hooks; the watch reads this step when the closure returns.
            wrapped = closure_calls_back(args, kwargs, lambda: self._after_closure(optimizer))
            if wrapped is not None:
                return wrapped
            if self._stepped_before(real):
                return None
        if self.setup is None or real not in self.stages.diagnosed:
            # The first step (with no model seen: its second one, whose gradients came from no forward pass ampdoctor
            # could see; the pre-flight reads what the optimizers hold), or an optimizer never diagnosed: a new
            # fold, a resume, a second stage.
            call_safely(self._start, blind=True, on_error=self.session.internal_error)
        if hooked and self._forward_handles:   # something the optimizers hold was not seen in a forward pass yet
            call_safely(self._note_unseen, real, on_error=self.session.internal_error)
        return None

    def _on_scaler_step(self, scaler: Any, optimizer: Any = None, *args: Any, **kwargs: Any) -> None:
        self._in_scaler_step += 1
        real = unwrap_optimizer(optimizer)
        self.stages.trains_again(scaler, *([real] if isinstance(real, torch.optim.Optimizer) else []))
        if self.session.broken or self.setup is None or not isinstance(real, torch.optim.Optimizer):
            return
        if real not in self.stages.diagnosed:   # a new stage's scaler.step(): its steps may all be skipped
            self._start(scaler)
        self.session.optimizer_stepped(real)

    def _left_scaler_step(self) -> None:
        self._in_scaler_step = max(0, self._in_scaler_step - 1)

    def _stepped_before(self, optimizer: Any) -> bool:
        """Note a step of ``optimizer`` before any model was seen; return whether it is its first: a checkpoint's
        state built before the training (one ``step()`` on set gradients), not yet the loop to look at blind."""
        if any(o is optimizer for o in self._stepped_unseen):
            return False
        self._stepped_unseen.append(optimizer)
        return True

    def _after_closure(self, optimizer: Any) -> None:
        """A step's closure returned: start without a model if it ran none ampdoctor could see (from its second
        step on), then read the step."""
        if self.setup is None and not self.models and not self.session.broken \
                and not self._stepped_before(unwrap_optimizer(optimizer)):
            call_safely(self._start, blind=True, on_error=self.session.internal_error)
        watch = self.session.watch
        if watch is not None:
            call_safely(watch.read_step, optimizer, on_error=self.session.internal_error)
        if self._forward_handles:
            call_safely(self._note_unseen, unwrap_optimizer(optimizer), on_error=self.session.internal_error)

    # ---- the looks: what the process trains now, handed to the session ---------------------------------------
    def _build_setup(self, scaler: Any = None) -> TrainingSetup:
        live = scan(self.stages.ended)
        models = trained_models(self.models, live.optimizers, live.modules)
        # models local to the script's main(), or bound to a name as DDP(model)
        self.session.names.note_script_names(models, _user_namespaces(), unwrap_module)
        scalers = [scaler] if scaler is not None else live.scalers
        scaler = next((s for s in scalers if is_enabled(s)), scalers[0] if scalers else None)
        dtypes = [d for d in (self._autocast.get(id(m)) for m in self.models) if d is not None]
        return TrainingSetup(models, live.optimizers, scaler, dtypes[0] if dtypes else None, _accelerator(),
                             facts=self.session.observers.facts, names=self.session.names,
                             loss_scaler=next(iter(live.loss_scalers), None))

    def _start(self, scaler: Any = None, blind: bool = False, at_end: bool = False) -> None:
        """Look at what the process trains and hand it to the session; ``blind``: also when no model was seen running
        a forward pass (the pre-flight reads the optimizers' tensors, --fix repairs nothing, and the report says what
        was not watched); ``at_end``: the run is over (no watch)."""
        if not self.models and not blind:
            return
        self._stepped_unseen = []   # looked at now: the optimizers are the setup's
        self._read_rank()
        if self.on_first_look is not None:
            call_safely(self.on_first_look)
            self.on_first_look = None   # once
        setup = self._build_setup(scaler)
        self.stages.handed_over(setup.optimizers, setup.scaler)
        self._internal.update(internal_optimizers(setup.optimizers))
        self.session.start(setup, self.models, self._autocast, repair=bool(self.models), watch=not at_end)
        self._follow_unseen()

    def _follow_unseen(self) -> None:
        """Keep the global forward hooks while a tensor the optimizers hold belongs to no model seen running a forward
        pass, so that its model is found when it runs (a model called only inside a loss module, a part called
        directly, a new stage's model); once every one does, discovery is done: stop paying two Python calls per
        module call. --fix keeps them to re-apply after a downcast."""
        setup = self.setup
        if setup is None:
            return
        for ref, entry, _ in list(self._unseen.values()):
            optimizer = ref()
            if entry is not None and optimizer is not None:
                self._note_unseen(optimizer)   # a model seen since: what it trains is watched now
        if any(held or free for held, free in (unseen_tensors(o, self.models, setup.models)
                                               for o in setup.optimizers)):
            self._hook_forwards()
        elif not self.fix:
            self._unhook_forwards()

    def _note_unseen(self, optimizer: Any) -> None:
        """At ``optimizer``'s step (its gradients came from a forward pass that ran before): note what it trains that
        no model seen running holds, named while the script's frames are there to name its models."""
        setup, known = self.setup, self._unseen.get(id(optimizer))
        if setup is None or (known is not None and known[0]() is optimizer and known[2] == len(self.models)):
            return   # read already, and no model seen since
        held, free = unseen_tensors(optimizer, self.models, setup.models)
        entry = None
        if held or free:
            ids = {id(p) for p in held}
            owners = [m for m in setup.models if any(id(p) in ids for p in m.parameters())]
            watch = self.session.watch
            entry = {"optimizer": setup.optimizer_label(optimizer), "tensors": len(held) + len(free),
                     "trained": sum(p.requires_grad for p in optimizer_tensors(optimizer)),
                     "models": [_script_name(m) for m in owners], "held": len(held), "free": len(free),
                     "followed": watch is not None and watch.follows(optimizer)}
        self._unseen[id(optimizer)] = (weakref.ref(optimizer), entry, len(self.models))

    def _read_rank(self) -> None:
        if self.rank_info is None:
            self.rank_info = from_process_group()
            if self.rank_info is not None:
                call_safely(self.on_rank, self.rank_info)

    def terminated(self) -> None:
        """End the run now: a SIGTERM stopped it while the script ran (the report covers the steps until then)."""
        terminated(self.report)
        self.detach()

    def interrupted(self, exc: BaseException) -> None:
        """Ctrl-C stopped the script (``exc``): the report covers the steps until then."""
        self.session.interrupted(exc)

    def not_started(self, exc: SyntaxError) -> None:
        """The script could not be compiled: nothing ran."""
        self.session.not_started(exc)

    # ---- crash explanation -----------------------------------------------------------------------------------
    def explain(self, exc: BaseException) -> list[Finding]:
        """Explain ``exc`` from the catalog, record it in the report and return the findings."""
        self._read_rank()
        # Read the live objects again: the crash may come from a model or optimizer built after the first look (a
        # new fold), and the guard's own setup still names the ones it watched.
        setup = call_safely(self._build_setup, on_error=self.session.internal_error) if self.models else None
        return self.session.explain(exc, setup)


def _autocast_dtype(device: str) -> torch.dtype | None:
    try:
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    except RuntimeError:  # a device type autocast does not know, e.g. "meta"
        return None



def _user_namespaces() -> Iterator[dict[str, Any]]:
    """Yield the local variables of the user's frames on the stack now, outermost first: the script's module, then
    its ``main()``, then what that calls (read when the first one is asked for)."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            frames.append(frame)
        frame = frame.f_back
    for frame in reversed(frames):
        yield dict(frame_values(frame))


def _script_name(module: nn.Module) -> str:
    """Return ``model (Sequential)``: the name the user's frames give ``module``, and its class (the class alone
    where none does)."""
    kind = type(module).__name__
    for namespace in _user_namespaces():
        name = script_bindings(namespace, unwrap_module).get(id(module))
        if name is not None:
            return f"{name} ({kind})"
    return kind


def _accelerator() -> Any:
    if not accelerator_built():   # one gc scan, only once an Accelerator was built
        return None
    found = [o for o in instances(object) if type(o).__name__ == "Accelerator"]
    return found[0] if found else None
