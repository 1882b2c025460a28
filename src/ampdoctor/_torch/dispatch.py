"""torch's dispatcher internals: a mode that sees every ATen op, an op's schema, and the leaves of nested outputs.

``torch.utils._python_dispatch.TorchDispatchMode`` (torch 2.0+) is the base class of a mode that sees every op after
autograd and autocast did their work. Without it ``TorchDispatchMode`` is ``object``; the modes built on it then never
see an op, and ``dispatch_modes_available()`` says so, so their callers can report "not traced" instead.
``OpOverload._schema`` names an op's arguments and says whether it writes one in place; without it the inputs are
numbered (``input[0]``) instead of named and every op counts as not in-place (its inputs are measured after it ran).
``torch.utils._pytree.tree_leaves`` flattens what a module or op returns (tuples, lists, dicts, dataclass-like
outputs torch registers); without it lists, tuples and dicts are walked here, other containers are one leaf.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - a torch without Python dispatch modes
    TorchDispatchMode = object  # type: ignore[assignment,misc]

try:
    from torch.utils._python_dispatch import (
        _disable_current_modes,
        _get_current_dispatch_mode,
        _get_current_dispatch_mode_stack,
    )
except ImportError:  # pragma: no cover
    _get_current_dispatch_mode = _get_current_dispatch_mode_stack = _disable_current_modes = None

try:
    from torch.utils.flop_counter import flop_registry as _FLOP_REGISTRY
except ImportError:  # pragma: no cover - torch < 2.1
    _FLOP_REGISTRY = None

try:
    from torch.utils._pytree import tree_leaves as _pytree_leaves
except ImportError:  # pragma: no cover
    _pytree_leaves = None

__all__ = ["TorchDispatchMode", "dispatch_modes_available", "innermost_mode", "modes_paused", "mode_is_on",
           "other_modes_on", "LOCAL_SCALAR", "op_flops", "op_schema", "op_writes_in_place", "op_is_random",
           "tree_leaves"]


def dispatch_modes_available() -> bool:
    """Return whether this torch has Python dispatch modes (``TorchDispatchMode`` is a real mode, not ``object``).

    >>> dispatch_modes_available()
    True
    """
    return TorchDispatchMode is not object


def innermost_mode() -> Any:
    """Return the dispatch mode that sees the next op first (the last one entered), None when none is on."""
    return _get_current_dispatch_mode() if _get_current_dispatch_mode is not None else None


def modes_paused() -> Any:
    """Return a context in which no dispatch mode sees the ops (they are put back after it)."""
    return _disable_current_modes() if _disable_current_modes is not None else contextlib.nullcontext()


LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default   # ``Tensor.item()``'s op


def other_modes_on() -> bool:
    """Return whether a dispatch mode or a torch function mode is on (someone's: a flop counter, a profiler's): a
    mode entered now, above it, could be popped by its ``__exit__``."""
    if _get_current_dispatch_mode_stack is not None and _get_current_dispatch_mode_stack():
        return True
    stack = getattr(torch.overrides, "_get_current_function_mode_stack", None)
    return bool(stack()) if stack is not None else False


def mode_is_on(mode: Any) -> bool:
    """Return whether ``mode`` is on this thread's stack of dispatch modes (something may have left it: a custom
    autograd Function's forward restores the stack it started with)."""
    if _get_current_dispatch_mode_stack is None:
        return False
    return any(m is mode for m in _get_current_dispatch_mode_stack())


def op_is_random(func: Any) -> bool:
    """Return whether an ATen op draws from the random generator (dropout, ``bernoulli_``, ``randn``): its tags say so.

    >>> import torch
    >>> op_is_random(torch.ops.aten.bernoulli_.float), op_is_random(torch.ops.aten.mul.Tensor)
    (True, False)
    """
    tag = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)
    return tag is not None and tag in getattr(func, "tags", ())


def op_flops(func: Any, args: Any, kwargs: Any) -> int | None:
    """Return the FLOPs of a matmul or convolution op on these arguments (torch's flop counter's formulas), None
    for an op it has no formula for.

    >>> import torch
    >>> op_flops(torch.ops.aten.mm.default, (torch.ones(3, 4), torch.ones(4, 5)), {})
    120
    """
    if _FLOP_REGISTRY is None:
        return None
    packet = getattr(func, "overloadpacket", None)
    formula = _FLOP_REGISTRY.get(packet)
    name = getattr(packet, "__name__", "")
    if formula is None and name.endswith("_"):   # addmm_: the formula of addmm
        formula = _FLOP_REGISTRY.get(getattr(torch.ops.aten, name[:-1], None))
    if formula is None:
        return None
    try:
        return int(formula(*args, **kwargs, out_val=None))
    except Exception:  # noqa: BLE001 - a formula that needs the output's shape, or an odd overload
        return None


def op_schema(func: Any) -> Any:
    """Return an ATen op's schema (``.arguments``, ``.is_mutable``), None when it carries none.

    >>> import torch
    >>> [a.name for a in op_schema(torch.ops.aten.add.Tensor).arguments][:2]
    ['self', 'other']
    """
    return getattr(func, "_schema", None)


def op_writes_in_place(func: Any) -> bool:
    """Return whether an ATen op writes one of its inputs (its schema is mutable); False when unknown.

    >>> import torch
    >>> op_writes_in_place(torch.ops.aten.add_.Tensor), op_writes_in_place(torch.ops.aten.add.Tensor)
    (True, False)
    """
    return bool(getattr(op_schema(func), "is_mutable", False))


def tree_leaves(tree: Any) -> list[Any]:
    """Return the leaves of a nested structure of tuples, lists and dicts (and what else torch's pytree knows).

    >>> tree_leaves(((1, [2, 3]), {"a": 4}))
    [1, 2, 3, 4]
    """
    if _pytree_leaves is not None:
        return _pytree_leaves(tree)
    return _walk(tree)


def _walk(tree: Any) -> list[Any]:
    """The fallback of ``tree_leaves``: lists, tuples and dicts (in insertion order), everything else a leaf."""
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _walk(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in _walk(item)]
    return [tree]
