"""Re-run each low-precision ATen op of an audited step in higher precision, and say where precision is lost.

On an audited step an `AuditMode` (a ``TorchDispatchMode``, below autograd and autocast) sees every ATen op of the
forward, the backward and an activation checkpoint's recompute. Each op that computes in fp16, bf16 or fp8 runs once
more on copies of its inputs upcast to fp32 (the *reference*; fp32 ops against float64 with ``reference=float64``),
and the two results are compared on the device, with no host read until the step's one host copy:

* **inf or NaN where the reference is finite**, and **0 where the reference is a normal number** (no rounding makes
  a normal number 0: the op lost it, an overflow inside a norm's ``x.pow(2)`` for one);
* **the error** ``max |out - ref| / max |ref|`` in units of the format's unit roundoff (2**-11 fp16, 2**-8 bf16):
  rounding the result alone costs at most 0.5;
* **a scalar argument the op's dtype cannot hold** (``clamp_min(x, 1e-12)`` in fp16: the floor is 0), read on the
  host from the op's arguments;
* **a cast that moves positions, timesteps or indices by a whole unit** (bf16 holds whole numbers exactly only up
  to 256, fp16 up to 2048): a cast, ``arange`` or ``linspace`` into a half format of whole numbers (or of a vector
  such as a batch's timesteps) that no gradient flows into.

Alongside, a ``TorchFunctionMode`` notes autocast's state at each torch call (inside the dispatcher autocast's keys
are excluded, so a dispatch mode cannot read it): a matmul or convolution that arrives in fp32 while autocast to a
half format is on for its device did not get autocast (an ``out=`` or in-place variant, a custom kernel), which
costs its FLOPs at fp32 speed. Global module hooks, on only while the audit is, keep the module stack (the names in
findings) and the autocast state of each module's forward: a module whose forward runs again inside the backward
(a checkpoint's recompute) under another autocast state computes gradients of other activations than the forward
used. A backward op is named after the forward op whose node it runs (the node's ``metadata``).

Do no harm: the op's own result is what training uses; the reference runs on copies of every tensor argument (an
in-place or ``out=`` op, or ``native_batch_norm``'s running statistics, are written there), random ops (dropout) are
never re-run, so the random stream is the user's. Memory: one op's inputs in higher precision at a time. The cost is
one more op (and a few reductions) per low-precision op, on audited steps only; the modes and hooks are not installed
on other steps.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ampdoctor._torch.autograd import current_node, in_backward
from ampdoctor._torch.dispatch import (
    LOCAL_SCALAR,
    TorchDispatchMode,
    innermost_mode,
    mode_is_on,
    modes_paused,
    op_flops,
    op_is_random,
    op_schema,
    other_modes_on,
    tree_leaves,
)
from ampdoctor._torch.distributed import distributed_world
from ampdoctor._torch.module_hooks import remove_global_hook
from ampdoctor._torch.modules import forward_with, has_hooks
from ampdoctor.core.dtypes import dtype_name

__all__ = ["NumericsAudit", "Site", "OpRecord", "Event", "LOW_DTYPES", "unit_roundoff", "GRADED_ULPS"]

LOW_DTYPES = frozenset({torch.float16, torch.bfloat16} | {getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)})

# An op whose result is many times the format's unit roundoff away from its own inputs' reference lost precision
# itself. Rounding the result costs at most 0.5 units; fp32-accumulated matmuls and reductions stay near that: the
# healthy real-model runs of tests/real (MiniLM, a diffusers UNet and VAE, a tiny Llama, bf16 and fp16) stay below
# 3 units (bench/audit.py prints their largest): 32 leaves a margin of 10.
GRADED_ULPS = 32.0

# Ops whose result is exact (data movement, selection, comparisons) or none of the audit's business.
_EXACT = frozenset({
    "clone", "contiguous", "detach", "alias", "lift_fresh", "lift_fresh_copy", "cat", "stack", "split", "chunk",
    "index", "index_select", "gather", "scatter", "scatter_add", "index_put", "index_add", "index_copy", "embedding",
    "embedding_dense_backward", "select_backward", "slice_backward", "slice_scatter", "select_scatter",
    "as_strided_scatter", "diagonal_backward", "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "zero", "constant_pad_nd", "relu",
    "threshold_backward", "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "neg", "abs", "sign",
    "max", "min", "amax", "amin", "sort", "topk", "argmax", "argmin", "flip", "roll", "repeat", "tril", "triu",
    "masked_select", "nonzero", "where", "masked_fill", "masked_scatter", "_local_scalar_dense", "item",
    "resize", "set", "copy", "fill", "full", "full_like", "new_full", "scalar_tensor", "_unsafe_index",
    "unfold", "im2col", "col2im", "pixel_shuffle", "pixel_unshuffle", "native_dropout", "native_dropout_backward",
    "_pin_memory", "_to_dense", "to_dense", "_assert_tensor_metadata", "sym_size", "sym_stride", "sym_numel",
})
# ...but their scalar arguments are still read (a fill value that is -inf in fp16): see _CONSTANT_OPS
_CONSTANT_OPS = frozenset({
    "clamp", "clamp_min", "clamp_max", "add", "sub", "rsub", "mul", "div", "masked_fill", "fill", "full",
    "full_like", "new_full", "where", "addcmul", "addcdiv", "lerp", "hardtanh", "threshold", "nan_to_num",
    "scalar_tensor",
})
_FILLS = frozenset({"masked_fill", "fill", "full", "full_like", "new_full", "where", "scalar_tensor"})
_CASTS = frozenset({"_to_copy", "copy", "arange", "linspace"})
_GEMMS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "convolution", "_convolution",
                    "_scaled_mm", "_trilinear"})
# the torch calls whose inputs autocast casts to a half format: a matmul of theirs arriving in fp32 bypassed it
_AUTOCAST_GEMM_CALLS = frozenset({
    "mm", "matmul", "__matmul__", "__rmatmul__", "linear", "bmm", "addmm", "addmm_", "baddbmm", "baddbmm_",
    "addbmm", "addbmm_", "addmv", "addmv_", "mv", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "einsum", "chain_matmul", "tensordot", "bilinear",
})
_DEVICES = ("cpu", "cuda")
_PLAIN = (torch.Tensor, nn.Parameter)
_AMPDOCTOR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# ampdoctor's frames an op of the user's passes through: this module, and the wrappers around torch and the user's
# calls (``torch.autograd.backward`` observed by the loss's part, ``ampdoctor.audit`` calling the user's batch_fn)
_PASSED_THROUGH = (os.path.abspath(__file__), os.path.join(_AMPDOCTOR, "core", "patch.py"),
                   os.path.join(_AMPDOCTOR, "monitor", "parts", "audit.py"))
_SKIPPED_FILES = (os.path.dirname(torch.__file__) + os.sep, *_PASSED_THROUGH,
                  os.path.dirname(os.__file__) + os.sep + "contextlib.py",
                  os.path.dirname(os.__file__) + os.sep + "functools.py")
_LOST_SHARE = 2.0 ** -4
_SATURATES = {"float8_e4m3fn": ", and it has no inf: above it values are clipped to it",
              "float8_e4m3fnuz": ", and it has no inf: above it values are clipped to it"}
_STATS = 7   # per op: new non-finite, NaN in the result, lost normals, largest error, largest |ref|, whole numbers,
#              zeros in the result


def unit_roundoff(dtype: torch.dtype) -> float:
    """Return the unit roundoff of a floating format: half the distance from 1 to the next number.

    >>> unit_roundoff(torch.float16), unit_roundoff(torch.bfloat16)
    (0.00048828125, 0.00390625)
    """
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class Site:
    """Where an op ran: the ATen op, the phase, the innermost named module and the source line that called it.

    Attributes:
        op: the ATen overload (``aten.pow.Tensor_Scalar``).
        phase: ``forward``, ``backward`` or ``recompute`` (a module's forward run again inside the backward).
        dtype: the format it computed in (``float16``).
        module: the innermost running module, as the findings name it (``encoder.norm``); ``""``: none.
        module_class: its class (``T5LayerNorm``).
        where: the innermost source line outside torch and ampdoctor (``model.py:42``), of the forward op for a
            backward op.
        node: a backward op's autograd node (``PowBackward0``); forward: the forward op a backward op belongs to.
    """

    op: str
    phase: str
    dtype: str
    module: str = ""
    module_class: str = ""
    where: str = ""
    node: str = ""
    forward: str = ""

    def describe(self) -> str:
        """Return the op as a finding names it: ``aten.pow.Tensor_Scalar at model.py:12`` (the backward of ...)."""
        what = self.op if self.phase != "backward" else \
            f"{self.op} in the backward of {self.forward or self.node}"
        if self.phase == "recompute":
            what += " (recomputed in the backward)"
        return f"{what} at {self.where}" if self.where else what

    def module_text(self) -> str:
        """Return the module as findings name it: ``encoder.norm (T5LayerNorm)``, or ``(outside any module)``."""
        if not self.module:
            return "(outside any module)"
        return f"{self.module} ({self.module_class})" if self.module_class else self.module


@dataclass(frozen=True)
class OpRecord:
    """One audited op: its site, and what its device values are about (``cast``: a cast, ``arange`` or
    ``linspace`` into a half format of a tensor no gradient flows into; ``source``: its dtype and shape, ``rank``: its
    number of dimensions; ``module_output``: a module's output against its fp32 shadow, not one op)."""

    site: Site
    cast: bool = False
    source: str = ""
    rank: int = 0
    module_output: bool = False


@dataclass(frozen=True)
class Event:
    """What the audit saw at one op: ``kind`` is ``nonfinite``, ``zeros``, ``constant``, ``integer``, ``graded``,
    ``fp32-gemm`` or ``recompute``; ``text`` says it with the values; ``ulps`` the op's error in roundoff units."""

    kind: str
    site: Site
    text: str
    index: int = 0
    ulps: float = 0.0
    numbers: dict[str, Any] = field(default_factory=dict)


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype | None], ...]:
    """Return autocast's state for each device type: (device, enabled, its dtype)."""
    state = []
    for device in _DEVICES:
        try:
            enabled = torch.is_autocast_enabled(device)
            state.append((device, enabled, torch.get_autocast_dtype(device) if enabled else None))
        except (RuntimeError, TypeError, AttributeError):   # an unknown device type on this torch
            continue
    return tuple(state)


def _state_text(state: Sequence[tuple[str, bool, Any]]) -> str:
    on = [f"{dtype_name(dtype)} ({device})" for device, enabled, dtype in state if enabled]
    return f"autocast to {', '.join(on)}" if on else "no autocast"


@functools.lru_cache(maxsize=4096)
def _held(value: float, dtype: torch.dtype) -> float:
    """Return ``value`` as ``dtype`` holds it (1e-12 -> 0.0 in fp16)."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).to(torch.float64))


def _caller() -> tuple[str, bool]:
    """Return ``file:line`` of the innermost frame outside torch, this module, ampdoctor's call wrappers and
    contextlib ("" when none), and whether that frame is ampdoctor's own (a monitor's hook: not the user's op)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_AMPDOCTOR) and not path.startswith(_PASSED_THROUGH):
            return path, True
        if not path.startswith(_SKIPPED_FILES) and not path.startswith("<frozen"):
            try:
                shown = os.path.relpath(path)
            except ValueError:   # another drive (Windows)
                shown = path
            return f"{shown if not shown.startswith('..') else os.path.basename(path)}:{frame.f_lineno}", False
        frame = frame.f_back
    return "", False


class _AutocastTracker(torch.overrides.TorchFunctionMode):
    """Note autocast's state at each torch call, for the dispatch mode below it."""

    def __init__(self, audit: "NumericsAudit") -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.audit.region = _autocast_state()
        self.audit.call = getattr(func, "__name__", "")
        return func(*args, **(kwargs or {}))


class AuditMode(TorchDispatchMode):
    """See every ATen op of an audited step; `NumericsAudit.observe` re-runs and compares it."""

    def __init__(self, audit: "NumericsAudit") -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.audit.observe(func, args, kwargs or {})


class NumericsAudit:
    """The audit of one or more steps: `start` it before the step's first forward, `stop` it once its gradients
    are final, hand `pending` to the step's host copy and read the `events` of what came back.

    Args:
        labels: the findings' names of the run's modules, by module.
        reference: the higher precision fp16/bf16/fp8 ops are compared with (fp32), and the one fp32 ops are
            compared with when ``audit_fp32`` (float64).
        audit_fp32: also compare fp32 ops with float64 (on request: it doubles the cost of an fp32 model).
        max_ops: the ops audited per step at most (the rest are counted, not re-run).
        on_error: told an exception raised inside the audit (the op is named); the audit is off from then on.

    >>> audit = NumericsAudit({})
    >>> x = torch.tensor([300.0, 0.0], dtype=torch.float16)
    >>> audit.start()
    True
    >>> _ = x.clamp_min(1e-12)
    >>> audit.stop()
    >>> [e.text for e in audit.events(audit.pending().tolist())]
    ['min=1e-12 is 0 in float16: aten.clamp_min.default sets a bound of 0']
    """

    def __init__(self, labels: dict[nn.Module, str] | None = None, *, audit_fp32: bool = False, max_ops: int = 20000,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self._labels = {id(m): (label, type(m).__name__) for m, label in (labels or {}).items()}
        self._keep = list((labels or {}).keys())   # the ids above stay valid while the audit lives
        self.audit_fp32, self.max_ops, self._on_error = audit_fp32, max_ops, on_error
        self.region: tuple[tuple[str, bool, Any], ...] = ()
        self.call = ""   # the torch function the user called last (its ops follow)
        self.off = False
        self.ops = 0          # ops seen that computed in a low-precision format (or fp32, with audit_fp32)
        self.truncated = 0    # of those, not re-run (over max_ops)
        self.gemm_flops = 0   # the forward's matmul and convolution FLOPs
        self.records: list[OpRecord] = []
        self._stats: list[torch.Tensor] = []
        self._host_events: list[Event] = []
        self._stack: list[tuple[nn.Module, bool]] = []
        self._first_state: dict[int, tuple[Any, ...]] = {}
        self._mismatched: set[int] = set()
        self._randomized: set[int] = set()   # modules whose forward drew random numbers (dropout)
        self._where: dict[int, str] = {}     # the source line that called each module
        self._shadowing = False
        self._world = distributed_world()    # the fp32 re-run of a module is for a process alone
        self._recent: tuple[list[torch.Tensor], Site] | None = None
        self._modes: list[Any] = []
        self._handles: list[Any] = []

    # ---- on and off -----------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether the audit's modes are on now."""
        return bool(self._modes)

    def start(self, root: nn.Module | None = None) -> bool:
        """Switch the modes and module hooks on and return True; ``root``: a module whose forward is starting now
        (its own pre-hooks ran before the global ones were registered). Not while another mode is on (a profiler's,
        a flop counter's): its ``__exit__`` would pop the audit's mode instead of its own, so False."""
        if self.running or self.off or other_modes_on():
            return False
        self.region = _autocast_state()
        hooks = nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._module_starts),
                         hooks.register_module_forward_hook(self._module_ends, with_kwargs=True, always_call=True)]
        if root is not None:
            self._module_starts(root, ())
        self._modes = [_AutocastTracker(self), AuditMode(self)]
        for mode in self._modes:
            mode.__enter__()
        return True

    def stop(self) -> None:
        """Switch the modes and hooks off (the innermost dispatch mode must be the audit's: a mode the user entered
        after it and still holds keeps both on, and the audit says so through ``on_error`` when it detaches)."""
        if not self.running:
            return
        on = mode_is_on(self._modes[1])
        if on and innermost_mode() is not self._modes[1]:
            self.off = True   # its mode lets every op through from now on; it leaves when it can (detach)
            raise RuntimeError(f"another dispatch mode ({type(innermost_mode()).__name__}) was entered after the "
                               "audit's and is still on: the audit cannot leave without removing it")
        self._tag_nodes()
        if on:   # else the stack it was entered on is gone (entered inside a custom Function's forward)
            for mode in reversed(self._modes):
                mode.__exit__(None, None, None)
        self._modes = []
        for handle in self._handles:
            remove_global_hook(handle)
        self._handles, self._stack, self._recent = [], [], None

    def _leave(self) -> None:
        """After an error the audit is off; its modes leave at the first module boundary (not from inside its own
        dispatch handler, where its mode is off the stack and would be put back after it)."""
        with contextlib.suppress(RuntimeError):
            self.stop()

    def _fail(self, exc: BaseException, func: Any = None) -> None:
        self.off = True
        if self._on_error is not None:
            self._on_error(RuntimeError(f"auditing {func}: {type(exc).__name__}: {exc}") if func else exc)

    # ---- the module stack and recomputed forwards ------------------------------------------------------------------
    def _module_starts(self, module: nn.Module, args: Any) -> None:
        if self.off:
            self._leave()
            return
        if self._shadowing:
            return
        try:
            state, recompute = _autocast_state(), in_backward()
            if not recompute:
                self._first_state.setdefault(id(module), state)
            elif id(module) not in self._mismatched:
                first = self._first_state.get(id(module))
                inside = any(id(m) in self._mismatched for m, again in self._stack if again)
                if first is not None and first != state and id(module) in self._labels and not inside:
                    self._mismatched.add(id(module))
                    where, _ = _caller()
                    label, cls = self._labels[id(module)]
                    site = Site("forward", "recompute", "", label, cls, where)
                    self._host_events.append(Event(
                        "recompute", site, f"its forward ran under {_state_text(first)}; the recompute of the "
                        f"activation checkpoint in the backward runs it under {_state_text(state)}",
                        len(self.records)))
            if not (self._stack and self._stack[-1][0] is module):   # the root, pushed by start()
                self._stack.append((module, recompute))
                if not recompute and id(module) not in self._where:
                    self._where[id(module)] = _caller()[0]
        except Exception as exc:  # noqa: BLE001 - the audit steps aside, the forward goes on
            self._fail(exc)

    def _module_ends(self, module: nn.Module, args: Any, kwargs: Any = None, output: Any = None) -> None:
        if self.off:
            self._leave()
            return
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] is module:
                recompute = self._stack[i][1]
                del self._stack[i:]
                break
        else:
            return
        if self._shadowing or self.off or recompute or in_backward() or id(module) not in self._labels \
                or output is None:   # a forward that raised (always_call): nothing to compare
            return
        if id(module) in self._randomized or any(next(c.children(), None) is not None for c in module.children()):
            return   # a leaf module or a block of leaves (an attention, an MLP); one that drew random numbers cannot
            #          be re-run the same
        if self._world > 1 or hasattr(module, "_hf_hook") or any(has_hooks(c) for c in module.children()):
            return   # re-run, it would run collectives on this rank alone, accelerate's offload hook, or the hooks
            #          of its children (its own forward is called directly: its own hooks do not run)
        try:
            self._shadow(module, args, kwargs, output)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, f"the fp32 shadow of {self._labels[id(module)][0]}")

    def _shadow(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """Run a leaf module, or a block of leaves, once more on its inputs (and half weights) upcast to fp32, outside
        autocast, and compare its low-precision output with that: the error its ops accumulated together (a Python
        loop's sum, a norm's chain of ops, attention scores), where each op alone lost only its rounding."""
        out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.dtype in LOW_DTYPES
                    and t.numel() > 0), None)
        if out is None or len(self.records) >= self.max_ops:
            return
        up = functools.partial(_upcast, ref_dtype=torch.float32, copy_all=True)
        self._shadowing = True
        try:
            with modes_paused(), torch.no_grad(), contextlib.ExitStack() as stack:
                # its half weights upcast (fp32 ones as they are: a block is not copied), its buffers copied (a
                # BatchNorm in training writes them)
                state = {**{name: _upcast(t, torch.float32, False) for name, t in module.named_parameters()},
                         **{name: up(t) for name, t in module.named_buffers()}}
                for device in _DEVICES:
                    with contextlib.suppress(RuntimeError):
                        stack.enter_context(torch.autocast(device, enabled=False))
                try:
                    ref = forward_with(module, state, _map(up, tuple(args)), _map(up, dict(kwargs or {})))
                except (RuntimeError, TypeError, ValueError, NotImplementedError):
                    return   # a module that does not run on fp32 inputs as it is (weights it keeps elsewhere)
        finally:
            self._shadowing = False
        ref = next((t for t in tree_leaves(ref) if isinstance(t, torch.Tensor) and t.shape == out.shape), None)
        if ref is None:
            return
        label, cls = self._labels[id(module)]
        site = Site("module output", "forward", dtype_name(out.dtype), label, cls, self._where.get(id(module), ""))
        with modes_paused():
            of, rf = out.detach().float(), ref.float()
            fin = torch.isfinite(of) & torch.isfinite(rf)
            zero = torch.zeros((), device=of.device)
            diff = torch.where(fin, (of - rf).abs(), 0).amax()
            largest = torch.where(torch.isfinite(rf), rf.abs(), 0).amax()
            self._stats.append(torch.stack([zero, zero, zero, diff.float(), largest.float(), zero, zero]))
        self.records.append(OpRecord(site, module_output=True))

    def _module(self) -> tuple[str, str]:
        for module, _ in reversed(self._stack):
            named = self._labels.get(id(module))
            if named is not None:
                return named
        return ("", "")

    # ---- each op ---------------------------------------------------------------------------------------------------
    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` as asked and return its result; on the way, audit it (never raising: `on_error`)."""
        if args and not isinstance(args[0], torch.Tensor) and func is LOCAL_SCALAR:
            return args[0]   # a wrapped number (a Python scalar saved as a tensor) reaches a mode as the scalar
        if self.off or getattr(func, "namespace", "aten") != "aten":
            return func(*args, **kwargs)
        try:
            plan = self._plan(func, args, kwargs)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, func)
            plan = None
        out = func(*args, **kwargs)
        if plan is not None:
            try:
                self._compare(plan, func, out)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc, func)
        return out

    def _plan(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Before the op runs: decide whether it is audited, and copy its inputs upcast (they may be written)."""
        self._tag_nodes()
        seen = self._seen(func, args, kwargs)
        if seen is None:
            return None
        base, tensors, low, floating, where = seen
        node = current_node()
        phase = "forward" if node is None else ("recompute" if self._stack and self._stack[-1][1] else "backward")
        if base in _GEMMS and phase == "forward":
            self._count_gemm(func, args, kwargs, floating, low, where)
        if low is None and not (self.audit_fp32 and floating and all(t.dtype == torch.float32 for t in floating)):
            return None
        if base in _EXACT and base not in _CONSTANT_OPS and base != "copy":
            return None
        self.ops += 1
        if len(self.records) >= self.max_ops:
            self.truncated += 1
            return None
        dtype = _scaled_mm_dtype(args, kwargs) if base == "_scaled_mm" else low or torch.float32
        site = self._site(func, phase, dtype, node, where)
        if base in _CONSTANT_OPS:
            self._constants(func, args, kwargs, dtype, site)
        if base in _EXACT and base != "copy":
            return None
        ref_dtype = torch.float32 if low is not None else torch.float64
        source = tensors[-1] if base == "copy" and len(tensors) > 1 else (tensors[0] if tensors else None)
        cast = base in _CASTS and low is not None and (source is None or (
            source.dtype not in LOW_DTYPES and not source.requires_grad))
        # every tensor argument is copied: some ops write arguments their schema does not mark (native_batch_norm
        # updates the running statistics it is given)
        upcast = functools.partial(_upcast, ref_dtype=ref_dtype, copy_all=True)
        if base == "_scaled_mm":   # an fp8 GEMM: against the fp32 matmul of its dequantized inputs
            return site, (args, kwargs), None, dtype, None, base, False
        ref_args, ref_kwargs = (_map(upcast, args), _map(upcast, kwargs))
        return site, ref_args, ref_kwargs, dtype, (source if cast else None), base, cast

    def _seen(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Return what the audit needs of an op of the user's with floating tensors (its base name, tensors, the
        low-precision format it computes in or None, its floating tensors, its source line), None for any other
        (a view, a random op, a monitor's own reading)."""
        base = func.overloadpacket.__name__
        base = base[:-1] if base.endswith("_") and not base.endswith("__") else base
        if op_is_random(func):
            self._randomized.update(id(m) for m, _ in self._stack)
            return None
        if getattr(func, "is_view", False):
            return None
        leaves = tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if any(type(t) not in _PLAIN for t in tensors):
            return None   # a tensor subclass (DTensor, a fake tensor): its ops may run collectives or hold no values
        low = next((t.dtype for t in tensors if t.dtype in LOW_DTYPES), None)
        if low is None:
            low = next((v for v in leaves if isinstance(v, torch.dtype) and v in LOW_DTYPES), None)
        floating = [t for t in tensors if t.is_floating_point()]
        if low is None and not floating:
            return None
        where, ours = _caller()
        if ours:
            return None   # a monitor's own reading (a hook's aminmax), not the user's computation
        return base, tensors, low, floating, where

    def _count_gemm(self, func: Any, args: Any, kwargs: Any, floating: list[torch.Tensor], low: torch.dtype | None,
                    where: str) -> None:
        flops = op_flops(func, args, kwargs)
        self.gemm_flops += flops or 0
        if low is not None or not floating or any(t.dtype != torch.float32 for t in floating):
            return
        device = floating[0].device.type
        region = [dtype for d, enabled, dtype in self.region if d == device and enabled and dtype in LOW_DTYPES]
        if region and self.call in _AUTOCAST_GEMM_CALLS:   # a composite autocast keeps in fp32 (SDPA) is policy
            site = self._site(func, "forward", torch.float32, None, where)
            self._host_events.append(Event("fp32-gemm", site, f"computes in float32 inside autocast to "
                                           f"{dtype_name(region[0])}", len(self.records),
                                           numbers={"flops": flops or 0, "autocast": dtype_name(region[0])}))

    def _site(self, func: Any, phase: str, dtype: torch.dtype, node: Any, where: str) -> Site:
        name = f"aten.{func.__name__}" if not str(func).startswith("aten.") else str(func)
        if phase != "backward":
            label, cls = self._module()
            return Site(name, phase, dtype_name(dtype), label, cls, where)
        forward = node.metadata.get("ampdoctor") if node is not None else None
        if isinstance(forward, Site):
            return Site(name, phase, dtype_name(dtype), forward.module, forward.module_class, forward.where,
                        node.name(), forward.op)
        return Site(name, phase, dtype_name(dtype), node=node.name() if node is not None else "")

    def _constants(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype,
                   site: Site) -> None:
        schema = op_schema(func)
        names = [a.name for a in schema.arguments] if schema is not None else []
        given = [*zip(names, args), *kwargs.items()]
        for name, value in given:
            if not isinstance(value, float) or value == 0 or not math.isfinite(value):
                continue
            held = _held(value, dtype)
            if held == 0 or math.isinf(held) or (abs(held) == 1 and held != value):   # a 1 - eps bound that is 1
                shown = f"{held:g}"
                clamp = func.overloadpacket.__name__.startswith("clamp")
                effect = f"sets a bound of {shown}" if clamp else f"computes with {shown}"
                self._host_events.append(Event(
                    "constant", site, f"{name}={value:g} is {shown} in {dtype_name(dtype)}: {site.op} {effect}",
                    len(self.records), numbers={"argument": name, "value": value, "held": held}))

    def _compare(self, plan: Any, func: Any, out: Any) -> None:
        site, ref_args, ref_kwargs, dtype, source, base, cast = plan
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if site.phase != "backward" and outs:
            self._recent = (outs, site)
        try:
            ref = _dequantized_mm(*ref_args) if base == "_scaled_mm" else func(*ref_args, **ref_kwargs)
        except (RuntimeError, TypeError, NotImplementedError):   # no kernel for the higher precision: not compared
            return
        refs = [t for t in tree_leaves(ref) if isinstance(t, torch.Tensor)]
        pair = next(((o, r) for o, r in zip(outs, refs) if o.is_floating_point() and r.shape == o.shape
                     and o.numel() > 0), None)
        if pair is None:
            return
        o, r = pair[0].detach(), pair[1].detach()
        of, rf = o.to(_wide(o)), r.to(_wide(o))
        fin_r, fin_o = torch.isfinite(rf), torch.isfinite(of)
        tiny = torch.finfo(o.dtype).tiny
        both, rabs = fin_o & fin_r, rf.abs()
        largest = torch.where(fin_r, rabs, 0).amax()
        # a lost value: 0 where the reference is a normal number and at least 1/16 of the result's largest one (an
        # accumulation's rounding may zero an entry that cancels to far less)
        lost = (of == 0) & (rabs >= torch.clamp(largest * _LOST_SHARE, min=tiny))
        whole = torch.ones((), device=o.device)
        if source is not None and source.is_floating_point() and source.numel():
            whole = (source == source.round()).all().to(whole.dtype)
        # out of range: inf/NaN where the reference is finite, or a saturating format's largest value (fp8 e4m3fn
        # has no inf: a cast above 448 clips) where the reference is beyond it
        fmax = torch.finfo(o.dtype).max
        over = fin_r & (~fin_o | ((of.abs() >= fmax) & (rabs > fmax * (1 + torch.finfo(o.dtype).eps))))
        stats = torch.stack([over.sum().float(), torch.isnan(of).sum().float(), lost.sum().float(),
                             torch.where(both, (of - rf).abs(), 0).amax().float(), largest.float(), whole.float(),
                             (of == 0).sum().float()])
        self._stats.append(stats)
        self.records.append(OpRecord(site, cast=cast,
                                     source="" if source is None else f"{dtype_name(source.dtype)}"
                                     f"{list(source.shape)}", rank=1 if source is None else source.dim()))

    def _tag_nodes(self) -> None:
        """Name the autograd nodes of the last forward op after it: its backward ops are named by them."""
        if self._recent is None:
            return
        outs, site = self._recent
        self._recent = None
        for t in outs:
            node = t.grad_fn
            if node is not None:
                node.metadata.setdefault("ampdoctor", site)

    # ---- the results ----------------------------------------------------------------------------------------------
    def pending(self) -> torch.Tensor | None:
        """Return the device values of the ops audited since the last call, flat (None: none), for the host copy."""
        if not self._stats:
            return None
        values, self._stats = torch.stack(self._stats).reshape(-1), []
        return values

    def events(self, host: Sequence[float]) -> list[Event]:
        """Return what the audit saw in the ops whose values `pending` handed over (``host``: them, read), with
        the events found on the host; the records are consumed."""
        records, self.records = self.records, []
        events, self._host_events = list(self._host_events), []
        rows = [host[i:i + _STATS] for i in range(0, len(host), _STATS)]
        nan_after = _first_nan(records, rows)
        for i, (record, row) in enumerate(zip(records, rows)):
            events += _op_events(i, record, row)
        for event in events:   # a constant that is 0 or inf in the format matters when NaN/inf follows it
            if event.kind == "constant":
                event.numbers["nan_after"] = nan_after(event.index)
                row = rows[event.index] if event.index < len(rows) and records[event.index].site is event.site \
                    else None
                event.numbers["zeros_out"] = int(row[6]) if row is not None else 0
        return sorted(events, key=lambda e: e.index)

    def worst(self, host: Sequence[float], records: Sequence[OpRecord]) -> list[tuple[Site, float]]:
        """Return the audited ops with their error in roundoff units, worst first."""
        rows = [host[i:i + _STATS] for i in range(0, len(host), _STATS)]
        return sorted(((rec.site, _ulps(rec, row)) for rec, row in zip(records, rows)), key=lambda x: -x[1])


def _wide(t: torch.Tensor) -> torch.dtype:
    """The dtype an op's result and its reference are compared in: float64 for an fp32 op (its reference is)."""
    return torch.float64 if t.dtype in (torch.float32, torch.float64) else torch.float32


def _ulps(record: OpRecord, row: Sequence[float]) -> float:
    """The op's error in roundoff units: 0 where the reference's largest value is below the format's smallest
    normal number (subnormal results carry less precision by design)."""
    diff, scale = row[3], row[4]
    dtype = getattr(torch, record.site.dtype, torch.float32)
    if diff <= 0 or scale < torch.finfo(dtype).tiny:
        return 0.0
    return diff / scale / unit_roundoff(dtype)


def _first_nan(records: Sequence[OpRecord], rows: Sequence[Sequence[float]]) -> Callable[[int], str | None]:
    """Return what tells, for an op index, the first later op whose result holds NaN or inf (its description)."""
    bad = [(i, rec.site) for i, (rec, row) in enumerate(zip(records, rows)) if row[0] > 0 or row[1] > 0]

    def after(index: int) -> str | None:
        return next((f"{site.describe()}" for i, site in bad if i >= index), None)
    return after


def _op_events(index: int, record: OpRecord, row: Sequence[float]) -> list[Event]:
    nonfinite, _, zeros, diff, scale, whole = row[:6]
    site, out = record.site, []
    base = site.op.split(".")[1] if site.op.count(".") >= 1 else site.op
    base = base[:-1] if base.endswith("_") else base
    dtype = getattr(torch, site.dtype, torch.float32)
    if nonfinite > 0 and base not in _FILLS:
        out.append(Event("nonfinite", site, f"gave inf/NaN in {int(nonfinite)} entries where {_ref(dtype)} gives "
                         f"finite values (the largest |value| there: {scale:.3g}; {site.dtype}'s largest finite "
                         f"number is {torch.finfo(dtype).max:.5g}{_SATURATES.get(site.dtype, '')})", index,
                         numbers={"entries": int(nonfinite), "ref_absmax": scale}))
    if zeros > 0 and base not in _FILLS:
        out.append(Event("zeros", site, f"gave 0 in {int(zeros)} entries where {_ref(dtype)} gives a normal "
                         f"{site.dtype} number", index, numbers={"entries": int(zeros)}))
    if record.cast and diff >= 1 and (whole > 0 or record.rank <= 1):
        exact = round(2 / torch.finfo(dtype).eps)   # 2**(mantissa bits + 1): 256 bf16, 2048 fp16
        out.append(Event("integer", site, f"casts {record.source} {'of whole numbers ' if whole > 0 else ''}(up "
                         f"to {scale:.6g}) to {site.dtype}, which moves values by up to {diff:.3g} ({site.dtype} "
                         f"holds whole numbers exactly only up to {exact})", index,
                         numbers={"moved": diff, "largest": scale}))
    ulps = _ulps(record, row)
    if ulps >= GRADED_ULPS and record.module_output:
        out.append(Event("graded", site, f"is {ulps:.0f} units of {site.dtype} roundoff away from the same module run "
                         f"in float32 on the same inputs: its ops lost that much together, each alone at most its "
                         f"rounding", index, ulps=ulps))
    elif ulps >= GRADED_ULPS and not record.cast and nonfinite == 0:
        out.append(Event("graded", site, f"is {ulps:.0f} units of {site.dtype} roundoff away from the same op in "
                         f"{_ref(dtype)} on the same inputs (rounding alone costs 0.5)", index, ulps=ulps))
    return out


def _scaled_mm_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype:
    """The format an fp8 GEMM (``aten._scaled_mm``) writes its result in: ``out_dtype``, else its inputs'."""
    out = kwargs.get("out_dtype", args[6] if len(args) > 6 else None)
    return out if isinstance(out, torch.dtype) else args[0].dtype


def _dequantized_mm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The fp32 matmul an fp8 GEMM stands for: ``(a * scale_a) @ (b * scale_b) + bias`` (per-tensor or per-row
    scales broadcast as ``_scaled_mm`` applies them)."""
    names = ("self", "mat2", "scale_a", "scale_b", "bias")
    given = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
    a = given["self"].float() * given["scale_a"].float()
    b = given["mat2"].float() * given["scale_b"].float()
    out = a @ b
    return out + given["bias"].float() if given.get("bias") is not None else out


def _ref(dtype: torch.dtype) -> str:
    return "float64" if dtype == torch.float32 else "float32"


def _upcast(value: Any, ref_dtype: torch.dtype, copy_all: bool) -> Any:
    if isinstance(value, torch.dtype):
        return ref_dtype if value in LOW_DTYPES or (ref_dtype == torch.float64 and value == torch.float32) else value
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype in LOW_DTYPES or (ref_dtype == torch.float64 and value.dtype == torch.float32):
        return value.detach().to(ref_dtype)
    return value.detach().clone() if copy_all else value


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(fn, v) for v in tree)
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    return fn(tree)
