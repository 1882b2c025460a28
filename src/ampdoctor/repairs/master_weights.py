"""fp32 master weights for a model that stays in fp16/bf16, with the user's training loop unchanged.

This is the apex O2 / Megatron ``Float16Optimizer`` scheme, done on the *same* parameter objects: each fp16/bf16
parameter swaps its ``.data`` between two tensors.

* **Compute phase** (forward and backward): ``p.data`` is the half-precision copy, so activations and parameter
  gradients are half.
* **Update phase** (from the end of backward until the optimizer step): ``p.data`` is the fp32 master and ``p.grad``
  an fp32 gradient, accumulated in fp32 over micro-batches. ``GradScaler.unscale_`` (which refuses fp16 grads),
  ``clip_grad_norm_(model.parameters())`` and the optimizer then all see fp32, and the optimizer state is fp32.

An fp16 update ``w + lr*g`` rounds back to ``w`` when ``|lr*g|`` is below half a unit in the last place of ``w``
(``|w|·2**-12`` for fp16, ``|w|·2**-9`` for bf16: ``core.formats.lost_below``); the fp32 master keeps those small steps.

A write into the half copy between steps (open_clip's ``logit_scale.clamp_(0, math.log(100))`` after every step, a
``load_state_dict``, an EMA swap) reaches the master entry by entry: an entry the write changed takes the written
value, one it left as it was keeps its master. Reloading every master from the half copy instead loses the step
each time: open_clip's bf16 temperature stayed at 14.25 for good.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampdoctor._torch import foreach
from ampdoctor._torch.autograd import current_graph_task_id, queue_backward_callback, version_counter
from ampdoctor._torch.modules import own_parameters
from ampdoctor._torch.scaler import unscales_itself
from ampdoctor.core.dtypes import LOW_PRECISION
from ampdoctor.core.training import optimizer_tensors
from ampdoctor.repairs._state import (
    check_master_state_dict,
    is_managed,
    manager_of,
    master_refusal,
    migrate_state_,
    owner_refusal,
    set_managed,
)

__all__ = ["MasterWeights", "is_managed", "compute_dtype", "accumulating_grad"]  # is_managed: from repairs._state

_AMP_ATTRS = ("grad_scale", "found_inf")  # set on the optimizer by GradScaler.step for fused optimizers


class MasterWeights(torch.optim.Optimizer):
    """Keep fp32 master weights for the fp16/bf16 parameters of ``optimizer``, with the model left in half.

    Wrapping attaches hooks and needs nothing else: use the returned object (or keep using ``optimizer``) with
    ``GradScaler``, ``clip_grad_norm_``, LR schedulers and gradient accumulation as usual. Parameters that are
    already fp32, or frozen, pass through untouched. The half copy is refreshed from the master after each
    optimizer step and before the next forward, so forward and backward always run in half precision.

    Differences from a plain optimizer, all for the wrapped parameters:

    * After a successful ``step()`` the gradients have been used up: ``p.grad`` is None, as after
      ``zero_grad()``. Keep a reading of them (a norm, a histogram) from before the step.
    * Between ``backward()`` and ``step()`` the parameters are fp32 (the masters); outside that window they are
      half. Write weights through the parameter (``model.load_state_dict``, ``p.copy_`` or ``clamp_`` under
      ``no_grad``): each entry the write changes reaches its master exactly, and one it leaves as it was keeps its
      master's fp32 value (a ``clamp_`` that moves nothing loses no update). Writes through ``p.data`` in the
      half phase are not seen by the master.
    * Do not move or recast the model (``.to``, ``.half()``, ``.float()``) while attached; ``detach()`` first.
    * ``create_graph=True`` backward and sparse gradients are not supported.

    Args:
        optimizer: any ``torch.optim.Optimizer``, built over the model's (half) parameters.

    >>> import torch
    >>> model = torch.nn.Linear(4, 1).half()
    >>> opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=1e-3))
    >>> model(torch.ones(2, 4, dtype=torch.float16)).float().sum().backward()
    >>> model.weight.grad.dtype
    torch.float32
    >>> opt.step(); opt.zero_grad()
    >>> model.weight.dtype, opt.masters[0].dtype
    (torch.float16, torch.float32)
    """

    keeps_fp32_masters = True  # how `core.training.keeps_fp32_masters` recognises it without an import

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        # No super().__init__(): param_groups, state and defaults belong to the wrapped optimizer. Subclassing
        # Optimizer is what LR schedulers check (isinstance) before they accept the wrapper.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"MasterWeights wraps a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                "Build the optimizer over the model's parameters first: MasterWeights(torch.optim.AdamW(...))."
            )
        if isinstance(optimizer, MasterWeights):
            raise TypeError("optimizer is already a MasterWeights; wrap the plain optimizer once.")
        self.optimizer = optimizer
        self._params: list[torch.Tensor] = []
        self._halves: list[torch.Tensor] = []
        self._masters: list[torch.Tensor] = []
        self._index: list[int] = []  # position in optimizer.state_dict() numbering, the key of the saved master
        self._position: dict[int, int] = {}  # id(parameter) -> its index in the lists here
        # Compute-phase bookkeeping, per wrapped parameter; see _to_compute and _to_update.
        self._stash: list[torch.Tensor | None] = []
        self._marker: list[torch.Tensor | None] = []
        self._marker_version: list[int] = []
        self._accumulated: list[int] = []
        self._param_version: list[int] = []
        self._in_update = False
        self._queued_task: int | None = None
        self._handles: list[RemovableHandle] = []
        self._detached = False

        self._attach(self._select(optimizer_tensors(optimizer), start=0))
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))
        self._handles.append(optimizer.register_step_post_hook(self._after_step))
        # The global hook and the parameter hooks reach the wrapper through weak references: the garbage collector
        # cannot see through a tensor's hooks, so a strong one would keep model, optimizer and wrapper alive
        # forever. The optimizer's step hooks (plain Python) keep it alive for as long as the optimizer lives.
        self_ref = weakref.ref(self)

        def before_forward(module: nn.Module, args: Any) -> None:
            master_weights = self_ref()
            if master_weights is not None and master_weights._in_update:  # the only cost while nothing is pending
                master_weights._before_forward(module)

        handle = nn.modules.module.register_module_forward_pre_hook(before_forward)
        weakref.finalize(self, handle.remove)
        self._handles.append(handle)

    # ---- the Optimizer interface, delegated ------------------------------------------------------------------
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def _step_supports_amp_scaling(self) -> bool:  # read by GradScaler.step: fused optimizers unscale in-kernel
        return unscales_itself(self.optimizer)

    @property
    def masters(self) -> list[torch.Tensor]:
        """The fp32 master weights, one per wrapped parameter, in ``wrapped_params()`` order."""
        return list(self._masters)

    def wrapped_params(self) -> list[torch.Tensor]:
        """Return the half-precision parameters that have an fp32 master."""
        return list(self._params)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run the wrapped optimizer's step on the fp32 masters, then refresh the half copies."""
        # GradScaler.step sets grad_scale/found_inf on the object it was given (this one); the fused kernel reads
        # them from the optimizer that runs.
        forwarded = [name for name in _AMP_ATTRS if name in self.__dict__]
        for name in forwarded:
            setattr(self.optimizer, name, self.__dict__[name])
        try:
            return self.optimizer.step() if closure is None else self.optimizer.step(closure)
        finally:
            for name in forwarded:
                self.optimizer.__dict__.pop(name, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, including the fp32 gradients held for accumulation."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        # A marker left in p.grad (set_to_none=False) now holds zeros and counts as a plain half gradient.
        self._stash = [None] * len(self._params)
        self._marker = [None] * len(self._params)

    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped optimizer's state dict and the fp32 masters (by parameter position)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_weights": dict(zip(self._index, self._masters)),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of a ``MasterWeights``: optimizer state and exact fp32 masters."""
        saved = check_master_state_dict(state_dict, self._index, self._masters)
        # In the update phase the parameters are the fp32 masters, so the wrapped optimizer keeps the loaded state
        # in fp32 (Optimizer.load_state_dict casts floating state to each parameter's dtype).
        self._to_update()
        try:
            self.optimizer.load_state_dict(state_dict["optimizer"])  # first: if it refuses, the masters stay
            with torch.no_grad():
                if self._masters:
                    foreach.copy_(self._masters, [saved[index] for index in self._index])
        finally:
            self._to_compute(keep_grads=True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer; its fp16/bf16 parameters get fp32 masters."""
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # a set is the wrapped optimizer's to refuse
            params = list(params)  # a generator can be read only once
        param_group = {**param_group, "params": params}
        start = sum(len(group["params"]) for group in self.optimizer.param_groups)
        chosen = self._select(list(params), start)  # refuse before anything changes
        self._to_compute(keep_grads=True)  # the new parameters join in the half phase
        self.optimizer.add_param_group(param_group)
        self._attach(chosen)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:  # type: ignore[override]
        """Register ``hook`` on the wrapped optimizer (it receives that optimizer)."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> RemovableHandle:  # type: ignore[override]
        """Register ``hook`` on the wrapped optimizer (it receives that optimizer)."""
        return self.optimizer.register_step_post_hook(hook)

    # ---- attaching and detaching ------------------------------------------------------------------------------
    def detach(self) -> None:
        """Remove every hook and leave the parameters in half precision, holding the latest master values.

        Gradients are kept, cast to the parameter's dtype. The wrapped optimizer's state stays fp32.
        """
        if self._detached:
            return
        self._to_update()  # gathers every pending gradient into one fp32 gradient per parameter
        with torch.no_grad():
            if self._masters:
                foreach.copy_(self._halves, self._masters)
            for p, half in zip(self._params, self._halves):
                grad, p.grad = p.grad, None
                p.data = half
                if grad is not None:
                    p.grad = grad.to(half.dtype)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p in self._params:
            set_managed(p, None)
        self._in_update = False
        self._detached = True

    def __enter__(self) -> MasterWeights:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        return f"MasterWeights({type(self.optimizer).__name__}, {len(self._params)} fp32 masters)"

    # ---- phases -----------------------------------------------------------------------------------------------
    def _select(self, params: list[torch.Tensor], start: int) -> list[tuple[int, torch.Tensor]]:
        """Return (position, parameter) for each trainable fp16/bf16 parameter; raise for any that cannot be."""
        chosen = [(start + i, p) for i, p in enumerate(params) if p.requires_grad and p.dtype in LOW_PRECISION]
        for index, p in chosen:
            refusal = master_refusal(f"param[{index}]", p)
            if refusal is not None:
                raise refusal
        # DDP's reducer and DeepSpeed/Megatron/apex own their parameters' dtype and .data/.grad
        refusal = owner_refusal([p for _, p in chosen], "MasterWeights", [self.optimizer]) if chosen else None
        if refusal is not None:
            raise refusal
        return chosen

    def _attach(self, chosen: list[tuple[int, torch.Tensor]]) -> None:
        with torch.no_grad():
            for index, p in chosen:
                half = p.data
                master = half.to(torch.float32, memory_format=torch.preserve_format)
                migrate_state_(self.optimizer, p, torch.float32, f"param[{index}]")
                i = len(self._params)
                self._params.append(p)
                self._halves.append(half)
                self._masters.append(master)
                self._index.append(index)
                self._position[id(p)] = i
                self._stash.append(None)
                self._marker.append(None)
                self._marker_version.append(0)
                self._accumulated.append(0)
                self._param_version.append(version_counter(p))
                set_managed(p, self)
                hook = functools.partial(_on_grad_accumulated, weakref.ref(self), i)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def _grad_accumulated(self, i: int) -> None:
        self._accumulated[i] += 1
        # One callback per backward, whichever wrapped parameter's gradient lands first. The graph task id
        # (not a flag) makes a backward that raised before its callback ran harmless for the next one.
        task = current_graph_task_id()
        if task != self._queued_task:
            self._queued_task = task
            queue_backward_callback(self._at_backward_end)

    def _at_backward_end(self) -> None:
        self._queued_task = None
        if self._detached:
            return
        if not self._in_update:
            self._to_update()
            return
        # A second backward through a retained graph adds half gradients to the fp32 ones already in place.
        with torch.no_grad():
            for p in self._params:
                grad = p.grad
                if grad is not None and grad.dtype != torch.float32:
                    p.grad = grad.float()

    def _before_forward(self, module: nn.Module) -> None:
        # Only a module that owns a wrapped parameter ends the update phase, so a metric or an EMA model run
        # between backward and step leaves the fp32 gradients in place for unscale_ and clipping.
        for p in own_parameters(module):
            if id(p) in self._position:
                self._to_compute(keep_grads=True)
                return

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._to_update()  # gradients assigned by hand, or a step without backward

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._to_compute(keep_grads=False)

    def _to_update(self) -> None:
        """Switch to fp32: parameters become their masters, gradients become fp32 (with any held fp32 part)."""
        if self._in_update or self._detached:
            return
        with torch.no_grad():
            self._follow_half_writes()
            grads = self._fp32_grads()
            for i, p in enumerate(self._params):
                p.grad = None  # a parameter's grad must match its dtype at every moment
                p.data = self._masters[i]
                p.grad = grads[i]
                self._stash[i] = None
                self._marker[i] = None
        self._in_update = True

    def _follow_half_writes(self) -> None:
        """Carry into the masters what was written into the half copies since the last switch, entry by entry.

        The half copy held round(master) when it was last written here (``_to_compute``). An entry the write changed
        takes the written value exactly (half -> fp32 is exact): a ``clamp_`` that moved it (also when the master
        was past the bound: it is clamped too), ``fill_``, a loaded checkpoint. An entry the write left at
        round(master) keeps its master: a ``clamp_`` that moved nothing, an EMA swap and its swap back. Copying the
        whole half copy would throw the master's extra bits away at every write, and with them every update below
        half an ulp (open_clip clamps ``logit_scale`` after each step: its bf16 temperature never moved).
        """
        # A write into the half copy (model.load_state_dict, an EMA copy-back) bumps the parameter's version counter.
        written = [i for i, p in enumerate(self._params) if version_counter(p) != self._param_version[i]]
        if not written:
            return
        masters, halves = [self._masters[i] for i in written], [self._halves[i] for i in written]
        ours = [torch.empty_like(half) for half in halves]
        foreach.copy_(ours, masters)  # what _to_compute wrote: fp32 -> half, round to nearest even
        for master, half, rounded in zip(masters, halves, ours):
            # NaN != NaN: a NaN entry takes the half copy's value, which is what it was
            master.copy_(torch.where(half == rounded, master, half))

    def _fp32_grads(self) -> list[torch.Tensor | None]:
        """Return each parameter's fp32 gradient: a held one plus what backward added to its marker, or the half
        gradient converted; None where the parameter has none."""
        params, masters = self._params, self._masters
        grads: list[torch.Tensor | None] = [None] * len(params)
        add_to, add_from, convert_at, convert_from = [], [], [], []
        for i, p in enumerate(params):
            grad, stash = p.grad, self._stash[i]
            if self._holds(i, grad):
                grads[i] = stash
                if self._accumulated[i]:
                    add_to.append(stash)
                    add_from.append(grad)
            elif grad is not None:
                if grad.layout != torch.strided:
                    raise TypeError(
                        f"parameter param[{self._index[i]}] has a {grad.layout} gradient; MasterWeights supports "
                        "dense gradients only. Use a dense embedding (sparse=False), or keep that module fp32."
                    )
                convert_at.append(i)
                convert_from.append(grad)
        if add_to:
            foreach.add_(add_to, add_from)  # fp32 += half, in fp32
        if convert_from:
            # Allocate, then one bulk copy: no per-parameter kernel for the conversion.
            buffers = [torch.empty_like(masters[i]) for i in convert_at]
            foreach.copy_(buffers, convert_from)
            for i, buffer in zip(convert_at, buffers):
                grads[i] = buffer
        return grads

    def _holds(self, i: int, grad: torch.Tensor | None) -> bool:
        """Return whether the fp32 gradient held aside for parameter ``i`` still counts, ``grad`` being its
        ``.grad``: the marker placed next to it is still there, and only backward wrote it."""
        # The marker is the zeroed half gradient placed next to a held fp32 gradient. If it is still
        # p.grad and was only written by backward (one version bump per accumulation), nobody zeroed it.
        return (self._stash[i] is not None and grad is not None and grad is self._marker[i]
                and version_counter(grad) == self._marker_version[i] + self._accumulated[i])

    def _accumulating_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        i = self._position.get(id(p))
        if i is None or self._in_update or not self._holds(i, p.grad):
            return p.grad
        return self._stash[i]

    def _to_compute(self, keep_grads: bool) -> None:
        """Switch to half: refresh the half copies from the masters; hold the fp32 gradients aside if kept."""
        if not self._in_update or self._detached:
            return
        params, halves = self._params, self._halves
        with torch.no_grad():
            if params:
                foreach.copy_(halves, self._masters)  # fp32 -> half, round to nearest even
            held = []
            for i, p in enumerate(params):
                grad = p.grad
                p.grad = None
                p.data = halves[i]
                self._param_version[i] = version_counter(p)
                self._accumulated[i] = 0
                if keep_grads and grad is not None:
                    self._stash[i] = grad if grad.dtype == torch.float32 else grad.float()
                    held.append(i)
            if held:
                # A half gradient of zeros stands in p.grad while the fp32 one is held: backward adds into it in
                # place (0 + g is exact), and zero_grad() from any caller (model, optimizer) visibly removes it.
                markers = [torch.empty_like(halves[i]) for i in held]
                foreach.zero_(markers)
                for i, marker in zip(held, markers):
                    params[i].grad = marker
                    self._marker[i] = marker
                    self._marker_version[i] = version_counter(marker)
        self._in_update = False


def compute_dtype(param: torch.Tensor) -> torch.dtype | None:
    """Return the dtype forward and backward see ``param`` in when a ``MasterWeights`` keeps its fp32 master (its
    half copy's), else None.

    >>> model = torch.nn.Linear(2, 1).to(torch.bfloat16)
    >>> opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> compute_dtype(model.weight), compute_dtype(torch.zeros(1))
    (torch.bfloat16, None)
    >>> opt.detach(); compute_dtype(model.weight) is None
    True
    """
    wrapper = manager_of(param)
    if not isinstance(wrapper, MasterWeights):
        return None
    i = wrapper._position.get(id(param))
    return None if i is None else wrapper._halves[i].dtype


def accumulating_grad(param: torch.Tensor) -> torch.Tensor | None:
    """Return the gradient the next backward adds ``param``'s gradient to: ``param.grad``, except under a
    ``MasterWeights`` that holds the fp32 sum of the earlier micro-batches aside.

    Between micro-batches (from the next forward on) the wrapper keeps that sum aside and puts a zeroed half
    placeholder in ``param.grad``; backward adds to the placeholder, and the sum is what the micro-batches
    accumulated so far. Once a ``zero_grad()`` removed or zeroed the placeholder, it is ``param.grad`` again.

    >>> model = torch.nn.Linear(2, 1).to(torch.bfloat16)
    >>> opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> model(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum().backward()
    >>> summed = model.weight.grad
    >>> _ = model(torch.ones(1, 2, dtype=torch.bfloat16))   # the next micro-batch's forward
    >>> model.weight.grad.dtype, accumulating_grad(model.weight) is summed
    (torch.bfloat16, True)
    >>> opt.detach()
    """
    wrapper = manager_of(param)
    return wrapper._accumulating_grad(param) if isinstance(wrapper, MasterWeights) else param.grad


def _on_grad_accumulated(master_weights: weakref.ref[MasterWeights], i: int, param: torch.Tensor) -> None:
    wrapper = master_weights()
    if wrapper is not None:
        wrapper._grad_accumulated(i)
