"""Process-wide observers of torch functions that offer no hook, installed before the script's first line runs.

A script that does ``from torch.nn.utils import clip_grad_norm_`` at import binds whatever the module holds at that
moment. The Doctor therefore installs its pass-through observers when it attaches, before ``runpy`` starts the
script, so the names a script binds are the observed ones. Class methods (``Optimizer.load_state_dict``,
``GradScaler.load_state_dict``) are observed here too, because a resume can happen before any GradScaler guard
exists. Every observer only records and forwards; it never changes an argument or a result.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from ampdoctor._compat.lightning import precision_of
from ampdoctor.core.facts import ProcessFacts
from ampdoctor.core.patch import ImportHandle, PatchHandle, observe
from ampdoctor.guard.clipping import CLIP_FUNCTIONS
from ampdoctor.session.events import RunEvents
from ampdoctor.session.frameworks import is_placement_reload

# where Lightning's classes that take a precision live (lightning, and the standalone packages)
_PRECISION_OWNERS = (("lightning.fabric.fabric", "Fabric"), ("lightning_fabric.fabric", "Fabric"),
                     ("lightning.pytorch.trainer.trainer", "Trainer"), ("pytorch_lightning.trainer.trainer", "Trainer"))


class GlobalObservers:
    """Install the process-wide observers; they tell ``sink`` the events (``ampdoctor.session.events``).

    Args:
        sink: the run's ``RunEvents``.
        on_error: receives an exception raised by the sink (it never reaches the caller).
    """

    def __init__(self, sink: RunEvents, on_error: Callable[[BaseException], None]) -> None:
        self.sink = sink
        self.on_error = on_error
        self.facts = ProcessFacts()
        self._handles: list[PatchHandle] = []
        self._depth = 0   # an observed clip function may call another: report the outermost only
        self._wrapper: list[Any] = []   # max_norm of each framework clip wrapper in flight (accelerate's)
        self._done_wrapper: Any = None   # max_norm of the wrapper that just returned

    def attach(self, scaler_classes: tuple[type, ...]) -> list[PatchHandle]:
        """Install the observers; return their handles (the caller removes them in reverse order)."""
        err = self.on_error
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            for name in CLIP_FUNCTIONS:
                if callable(owner.__dict__.get(name)):
                    self._handles.append(observe(owner, name, before=functools.partial(self._before_clip, name),
                                                 after=self._after_clip, on_error=err, finally_=self._leave_clip))
        self._handles.append(observe(torch.optim.Optimizer, "load_state_dict", after=self._after_optimizer_load,
                                     on_error=err))
        for module, name in _PRECISION_OWNERS:   # installed if the script imports Lightning
            self._handles.append(ImportHandle(module, functools.partial(self._observe_precision, module, name),
                                              on_error=err))
        for cls in scaler_classes:
            if "load_state_dict" in vars(cls):
                self._handles.append(observe(cls, "load_state_dict", after=self._after_scaler_load, on_error=err))
            if "__init__" in vars(cls):
                self._handles.append(observe(cls, "__init__", after=self._after_scaler_init, on_error=err))
        return self._handles

    def attach_fsdp(self) -> list[PatchHandle]:
        """Observe FSDP's ``FullyShardedDataParallel.clip_grad_norm_`` once FSDP is imported; return new handles."""
        fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
        cls = getattr(fsdp, "FullyShardedDataParallel", None)
        if cls is None or self._observes(cls):
            return []
        handle = observe(cls, "clip_grad_norm_", before=self._before_fsdp_clip, after=self._after_clip,
                         on_error=self.on_error, finally_=self._leave_clip)
        self._handles.append(handle)
        return [handle]

    def attach_accelerate(self) -> list[PatchHandle]:
        """Observe ``accelerate.Accelerator.clip_grad_norm_`` once accelerate is imported; return new handles.

        accelerate 1.x clips through ``get_total_norm`` and ``clip_grads_with_norm_``, and not at all when the
        parameters are none or ``max_norm`` is inf: only the wrapper returns the pre-clip norm. torch's clips
        inside it still reach the GradScaler guard (they run after the wrapper's own ``unscale_gradients()``)."""
        module = sys.modules.get("accelerate.accelerator")
        cls = getattr(module, "Accelerator", None)
        if cls is None or not callable(vars(cls).get("clip_grad_norm_")) or self._observes(cls):
            return []
        handle = observe(cls, "clip_grad_norm_", before=self._before_wrapper_clip, after=self._after_wrapper_clip,
                         on_error=self.on_error, finally_=self._leave_wrapper_clip)
        self._handles.append(handle)
        return [handle]

    def _observes(self, cls: type) -> bool:
        return any(isinstance(h, PatchHandle) and h.owner is cls for h in self._handles)

    def _observe_precision(self, module: str, name: str) -> list[PatchHandle]:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is None or "__init__" not in vars(cls):
            return []
        return [observe(cls, "__init__", after=functools.partial(self._after_precision_owner_init, name),
                        on_error=self.on_error)]

    def _after_precision_owner_init(self, name: str, result: Any, owner: Any, *args: Any, **kwargs: Any) -> None:
        # Fabric(precision=...) and Trainer(precision=...) take it by keyword only; on a CPU both replace
        # "16-mixed" by "bf16-mixed" (lightning 2.x, fabric/connector.py and trainer/connectors/
        # accelerator_connector.py), with one warning among many and nothing left on the object that says so
        asked = str(kwargs.get("precision"))
        got = precision_of(owner)
        if asked in ("16", "16-mixed") and got is not None and got != "16-mixed":
            self.facts.record_precision_fallback(name, "16-mixed" if asked == "16" else asked, got)

    def _before_wrapper_clip(self, accelerator: Any, parameters: Any = None, max_norm: Any = None, *args: Any,
                             **kwargs: Any) -> None:
        self._wrapper.append(max_norm)

    def _leave_wrapper_clip(self) -> None:
        self._done_wrapper = self._wrapper.pop() if self._wrapper else None

    def _after_wrapper_clip(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if not self._wrapper and self._depth == 0:
            self.sink.wrapper_clipped(self._done_wrapper, result)

    def _before_clip(self, name: str, parameters: Any = None, *args: Any, **kwargs: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self.sink.before_clip(parameters, args, kwargs, name)

    def _leave_clip(self) -> None:   # runs before _after_clip, and also when the clip raised
        self._depth = max(0, self._depth - 1)

    def _after_clip(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if self._depth == 0:
            self.sink.after_clip(result, report_norm=not self._wrapper)

    def _before_fsdp_clip(self, module: Any, *args: Any, **kwargs: Any) -> None:
        self._before_clip("clip_grad_norm_", list(module.parameters()), *args, **kwargs)

    def _after_optimizer_load(self, result: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if is_placement_reload(optimizer):
            return  # accelerate.prepare() reloading the optimizer's own state onto its device: not a resume
        self.facts.record_optimizer_restored(optimizer)
        self.sink.optimizer_restored(optimizer)

    def _after_scaler_load(self, result: Any, scaler: Any, *args: Any, **kwargs: Any) -> None:
        self.facts.record_scaler_restored(scaler)
        self.sink.scaler_restored(scaler)

    def _after_scaler_init(self, result: Any, scaler: Any, *args: Any, **kwargs: Any) -> None:
        # GradScaler(device="cuda", init_scale=..., growth_factor=..., backoff_factor=..., growth_interval=...,
        # enabled=True): `enabled` is the sixth parameter after self.
        enabled = kwargs.get("enabled", args[5] if len(args) > 5 else True)
        self.facts.record_scaler_built(scaler, bool(enabled))
