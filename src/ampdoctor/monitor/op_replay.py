"""Find the first ATen op that turned finite values into inf or NaN, and the module that ran it.

Module hooks see a module's inputs and outputs, not the ops inside its ``forward``. When a module's inputs and
weights are finite and its output is not, or when a container's children were all finite, the culprit is one of
the ops in between. :func:`first_nonfinite_op` runs a function under a ``TorchDispatchMode`` that checks the output
of every ATen op, like RETURNN's ``debug_inf_nan``, and names the innermost module that was running.

Every op pays one host sync, so this is a tool for re-running one failing forward, never for every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ampdoctor._torch.dispatch import TorchDispatchMode, op_schema, op_writes_in_place, tree_leaves
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.host_reads import HostReads, to_host
from ampdoctor.core.names import module_label
from ampdoctor.core.strict_json import json_float

__all__ = ["NonfiniteOp", "NonfiniteOpTracer", "first_nonfinite_op"]

# Ops that write inf on purpose (attention masks: masked_fill(-inf), where(mask, x, -inf), full(-inf)) or whose
# output is uninitialised memory (empty*), which may hold any bit pattern, NaN included.
IGNORED_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_",
    "full", "full_like", "new_full", "fill", "fill_", "masked_fill", "masked_fill_", "where", "scalar_tensor",
    "lift_fresh", "lift_fresh_copy",
})


@dataclass(frozen=True)
class TensorStat:
    """One tensor an op read or wrote: its role, dtype, shape and largest magnitude (``inf``/``nan`` included)."""

    role: str
    dtype: str
    shape: tuple[int, ...]
    abs_max: float

    def describe(self) -> str:
        return f"{self.role} {self.dtype}{list(self.shape)} abs-max {self.abs_max:.3g}"


@dataclass(frozen=True)
class NonfiniteOp:
    """The first op whose output held inf (or NaN) although none of its inputs did.

    Attributes:
        op: the ATen overload, for example ``"aten.exp.default"``.
        kind: ``"inf"`` or ``"nan"``.
        module: qualified name of the innermost module running the op (``"(root)"`` for the root module,
            ``"(outside any module)"`` when no module was running).
        module_class: that module's class name, or ``""``.
        module_stack: the modules being executed, outermost first.
        index: how many ATen ops ran before this one.
        inputs: the op's floating-point tensor inputs.
        outputs: the op's floating-point tensor outputs.

    >>> NonfiniteOp("aten.exp.default", "inf", "1", "Blowup", ("(root)", "1"), 3, (), ()).module
    '1'
    """

    op: str
    kind: str
    module: str
    module_class: str
    module_stack: tuple[str, ...]
    index: int
    inputs: tuple[TensorStat, ...]
    outputs: tuple[TensorStat, ...]

    def describe(self) -> str:
        """Return a one-line account, as shown in findings."""
        where = f"'{self.module}' ({self.module_class})" if self.module_class else self.module
        ins = "; ".join(s.describe() for s in self.inputs) or "no tensor inputs"
        outs = "; ".join(s.describe() for s in self.outputs)
        return (f"{self.op} in {where} produced {self.kind} from inputs without {self.kind} (op #{self.index}): "
                f"{ins} -> {outs}")

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict; non-finite numbers become the strings ``"inf"``/``"nan"``."""
        def stat(s: TensorStat) -> dict[str, Any]:
            return {"role": s.role, "dtype": s.dtype, "shape": list(s.shape), "abs_max": json_float(s.abs_max)}

        return {"op": self.op, "kind": self.kind, "module": self.module, "module_class": self.module_class,
                "module_stack": list(self.module_stack), "index": self.index,
                "inputs": [stat(s) for s in self.inputs], "outputs": [stat(s) for s in self.outputs]}


def first_nonfinite_op(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NonfiniteOp | None:
    """Run ``fn(*args, **kwargs)`` once and return the first op that produced inf or NaN from finite inputs.

    An op counts when its output holds inf while none of its inputs does, or NaN while none of its inputs does,
    so ``inf - inf`` is found as the NaN's origin, while ops that only carry a non-finite value along are not.
    Ops that write ``-inf`` on purpose (``masked_fill``, ``where``, ``full``) are skipped. When ``fn`` is an
    ``nn.Module``, modules are named by their qualified names in it; other modules are named the way
    ``torch.utils.module_tracker.ModuleTracker`` names them (``ClassName.child``). Module names cover the
    forward pass; ops run by ``backward()`` inside ``fn`` are checked but carry no module name.

    ``fn`` runs exactly once with the caller's grad mode, autocast state and RNG; the result is discarded.
    Wrap the call in ``torch.no_grad()`` for a forward-only re-run.

    >>> class Blowup(nn.Module):
    ...     def forward(self, x):
    ...         return (x * 1e3).exp() - 1
    >>> first_nonfinite_op(Blowup(), torch.full((2,), 0.05, dtype=torch.float16)).op
    'aten.exp.default'
    """
    with NonfiniteOpTracer(fn if isinstance(fn, nn.Module) else None) as tracer:
        fn(*args, **kwargs)
    return tracer.found


class NonfiniteOpTracer(TorchDispatchMode):
    """Check every op's outputs while active; ``.found`` is the first op that made inf/NaN (see above).

    Args:
        root: modules are named by their qualified names in ``root``; others like ``ModuleTracker`` does.
        within: only look at ops run while the module with this name is running (for example the module whose
            output turned non-finite), so that a harmless inf elsewhere (an overflow that is masked away) is not
            taken for the origin.
        reads: who its host reads (one per op looked at) count for (``ampdoctor.core.host_reads``).
        prefix: what ``root``'s names start with in a run of several models (``netD.``: ``module_label``).

    A stack of modules is kept with global forward hooks (always called, so it unwinds on errors).

    >>> x = torch.tensor([1e4], dtype=torch.float16)
    >>> with NonfiniteOpTracer() as tracer:
    ...     _ = x * 10
    >>> tracer.found.op
    'aten.mul.Tensor'
    """

    def __init__(self, root: nn.Module | None = None, *, within: str | None = None,
                 reads: HostReads | str = "op replay", prefix: str = "") -> None:
        super().__init__()
        self.reads = reads if isinstance(reads, HostReads) else HostReads(reads)
        self.names: dict[nn.Module, str] = {}
        if root is not None:
            self.names.update((m, module_label(n, prefix)) for n, m in root.named_modules(remove_duplicate=False))
        self.within = within
        self.stack: list[tuple[str, str]] = []
        self.found: NonfiniteOp | None = None
        self.count = 0
        self._handles: list[Any] = []

    # ModuleTracker keeps an unordered set of running modules; a stack tells which one is innermost.
    def _push(self, module: nn.Module, args: Any) -> None:
        self.stack.append((self._name(module), type(module).__name__))

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def _name(self, module: nn.Module) -> str:
        name = self.names.get(module)
        if name is None:  # a module outside `fn`'s tree: name it and its children like ModuleTracker does
            root = type(module).__name__
            self.names.update((m, f"{root}.{n}" if n else root)
                              for n, m in module.named_modules(remove_duplicate=False) if m not in self.names)
            name = self.names[module]
        return name

    def __enter__(self) -> "NonfiniteOpTracer":
        hooks = torch.nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._push),
                         hooks.register_module_forward_hook(self._pop, always_call=True)]
        try:
            return super().__enter__()
        except BaseException:
            self._remove()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        index = self.count
        self.count += 1
        if (self.found is not None or func.overloadpacket.__name__ in IGNORED_OPS
                or (self.within is not None and all(name != self.within for name, _ in self.stack))):
            return func(*args, **kwargs)
        # An in-place op overwrites its input, so inputs are measured before it runs.
        schema = op_schema(func)
        before = _stats(args, kwargs, "input", self.reads, schema) if op_writes_in_place(func) else None
        out = func(*args, **kwargs)
        outputs = _stats(out, {}, "output", self.reads)
        kind = _kind(outputs)
        if kind is not None:
            inputs = before if before is not None else _stats(args, kwargs, "input", self.reads, schema)
            if _kind(inputs, only=kind) is None:
                module, module_class = self.stack[-1] if self.stack else ("(outside any module)", "")
                self.found = NonfiniteOp(str(func), kind, module, module_class, tuple(n for n, _ in self.stack),
                                         index, tuple(inputs), tuple(outputs))
        return out


def _stats(args: Any, kwargs: dict[str, Any], role: str, reads: HostReads, schema: Any = None) -> list[TensorStat]:
    """Measure the floating-point tensors among ``args``/``kwargs`` with one host read.

    Inputs are named after the op's schema (``self``, ``mat1``, ``tensors[1]``) when it is given.
    """
    arg_names = [a.name for a in schema.arguments] if schema is not None else []
    named: list[tuple[str, torch.Tensor]] = []
    items = list(enumerate(args)) if isinstance(args, (tuple, list)) else [(None, args)]
    for i, value in items + [(key, value) for key, value in kwargs.items()]:
        base = (arg_names[i] if isinstance(i, int) and i < len(arg_names) else
                f"{role}[{i}]" if isinstance(i, int) else i if i is not None else role)
        leaves = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        named += [(base if len(leaves) == 1 else f"{base}[{j}]", t) for j, t in enumerate(leaves)]
    pairs: list[torch.Tensor] = []
    kept: list[tuple[str, torch.Tensor]] = []
    for role_name, t in named:
        if not t.is_floating_point() or t.numel() == 0 or t.is_meta:
            continue
        try:
            lo, hi = torch.aminmax(t.detach())  # one pass; NaN propagates, so NaN shows in both
        except (RuntimeError, NotImplementedError):  # dtypes aminmax lacks (float8): measure an fp32 copy
            lo, hi = torch.aminmax(t.detach().float())
        device = pairs[0].device if pairs else lo.device
        pairs += [lo.float().to(device), hi.float().to(device)]
        kept.append((role_name, t))
    if not kept:
        return []
    values = to_host(torch.stack(pairs).abs().view(-1, 2).amax(dim=1), reads)
    return [TensorStat(r, dtype_name(t), tuple(t.shape), v) for (r, t), v in zip(kept, values)]


def _kind(stats: list[TensorStat], only: str | None = None) -> str | None:
    """Return ``"nan"`` if any tensor holds NaN, else ``"inf"`` if any holds inf, else None."""
    kinds = {"nan" if math.isnan(s.abs_max) else "inf" for s in stats if not math.isfinite(s.abs_max)}
    if only is not None:
        return only if only in kinds else None
    return "nan" if "nan" in kinds else ("inf" if kinds else None)
