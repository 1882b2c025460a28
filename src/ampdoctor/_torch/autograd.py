"""Autograd internals: which backward is running, a callback at its end, and a tensor's version counter.

Without ``torch._C._current_graph_task_id`` (torch < 2.0), every probe answers "not in a backward" (-1), so a
monitor that skips recomputed forwards under checkpointing watches them too, which costs time, never correctness.
Without ``queue_callback`` the caller is told (False) and keeps its fallback. ``Tensor._version`` counts the
in-place writes autograd checks saved tensors against; an inference tensor has none (reading it raises), and the
answer is then None, as it would be on a torch without the counter: the caller cannot tell a write from none.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def current_graph_task_id() -> int:
    """Return the id of the backward running on this thread, -1 outside any backward.

    >>> current_graph_task_id()
    -1
    """
    return int(_GRAPH_TASK_ID()) if _GRAPH_TASK_ID is not None else -1


def in_backward() -> bool:
    """Return whether this thread is inside an autograd backward (e.g. a checkpoint recomputing its forward)."""
    return current_graph_task_id() != -1


def queue_backward_callback(callback: Callable[[], None]) -> bool:
    """Run ``callback`` once the current backward finishes; return False when the engine offers no such queue."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return False
    queue(callback)
    return True


def version_counter(tensor: torch.Tensor) -> int | None:
    """Return how many in-place writes ``tensor``'s storage has seen (its version), None when it keeps no count.

    >>> t = torch.zeros(2)
    >>> before = version_counter(t); _ = t.add_(1); version_counter(t) - before
    1
    >>> with torch.inference_mode():
    ...     version_counter(torch.zeros(2)) is None
    True
    """
    if tensor.is_inference():
        return None
    version = getattr(tensor, "_version", None)
    return version if isinstance(version, int) else None


def constant_factor(tensor: torch.Tensor) -> float | None:
    """Return ``c`` when ``tensor`` is ``x * c`` for a constant ``c`` kept on the CPU (``loss * 2**16``: a
    hand-written loss scaler), read from the graph node's saved operand; None otherwise. Reads no device memory.

    >>> w = torch.ones(2, requires_grad=True)
    >>> constant_factor(w.sum() * 2.0**16), constant_factor(w.sum())
    (65536.0, None)
    """
    node = getattr(tensor, "grad_fn", None)
    if node is None or node.name() != "MulBackward0":
        return None
    other = getattr(node, "_saved_other", None)
    if not isinstance(other, torch.Tensor) or other.numel() != 1 or other.device.type != "cpu" or other.requires_grad:
        return None
    return float(other)


_CURRENT_NODE = getattr(torch._C, "_current_autograd_node", None)


def current_node() -> Any:
    """Return the autograd node whose backward runs now on this thread (``MulBackward0``), None in a forward or
    on a torch without the probe.

    >>> current_node() is None
    True
    """
    return _CURRENT_NODE() if _CURRENT_NODE is not None else None
