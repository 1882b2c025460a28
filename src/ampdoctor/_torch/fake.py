"""Run a model on fake tensors and record how many bytes are live, without allocating them.

Two private pieces of torch are used, both only here:

* ``torch._subclasses.fake_tensor.FakeTensorMode``: tensors carry shape, dtype, device and strides but no data;
  every op runs its meta kernel, so a 7B model's forward and backward cost seconds and no memory.
* ``torch.utils._python_dispatch.TorchDispatchMode``: sees every op, in forward and in backward (the autograd
  engine's CPU thread inherits the mode), after autograd and autocast have done their work, so the tensors it sees
  are the ones the kernels write: autocast's half copies, what ``save_for_backward`` keeps, the gradients.

``StorageTimeline`` is that mode. It records an ``+nbytes`` event when an op returns a tensor whose storage it has
not seen and a ``-nbytes`` event when that storage is garbage collected (a ``weakref`` callback on the
``UntypedStorage``, whose Python object torch keeps alive as long as the storage: views share it). Replaying the
events gives the live bytes at every moment and their peak, and any set of storages (the gradients, found only
after backward) can be left out of the replay. The same mode on real tensors measures a real run; the tests
compare both with ``torch.profiler``'s allocator events.

Fallbacks: ``fake_mode()`` raises ``RuntimeError`` when this torch has no ``FakeTensorMode``; the caller then
reports no activation figure. Ops without a meta kernel (custom extensions) raise inside the fake run; the caller
reports the error instead of a number.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterable

import torch

from ampdoctor._torch.dispatch import TorchDispatchMode, tree_leaves

try:  # private; present since torch 2.0
    from torch._subclasses.fake_tensor import FakeTensorMode
except ImportError:  # pragma: no cover - a torch without fake tensors
    FakeTensorMode = None  # type: ignore[assignment,misc]

__all__ = ["fake_mode", "StorageTimeline", "storage_key", "is_fake"]


def fake_mode() -> Any:
    """Return a new ``FakeTensorMode`` that accepts real tensors as constants (they are converted on use)."""
    if FakeTensorMode is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch._subclasses.fake_tensor.FakeTensorMode")
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(tensor: torch.Tensor) -> bool:
    """Return whether ``tensor`` is a fake tensor (no data)."""
    return type(tensor).__name__ == "FakeTensor"


def storage_key(tensor: torch.Tensor) -> int:
    """Return an id of ``tensor``'s storage that views share (valid while the storage lives)."""
    return id(tensor.untyped_storage())


class StorageTimeline(TorchDispatchMode):  # type: ignore[misc,valid-type]
    """Record the allocation and release of every storage that an op creates while the mode is active.

    Attributes:
        events: ``(serial, nbytes)`` in order; ``nbytes`` is negative for a release. ``serial`` numbers storages
            in the order they were first seen.
        marks: ``{label: index into events}`` set by ``mark()``.

    >>> tl = StorageTimeline()
    >>> with tl:
    ...     a = torch.ones(256)            # 1 KiB
    ...     b = (a * 2).sum()              # 1 KiB product freed at once, 4 B result kept
    >>> tl.peak(), tl.live()
    (2052, 1028)
    """

    def __init__(self, known: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self.marks: dict[str, int] = {}
        self._serials: dict[int, int] = {}   # storage id -> serial, while it lives
        self._sizes: dict[int, int] = {}     # serial -> bytes now
        self._refs: dict[int, Any] = {}      # serial -> weakref of the storage
        self._counter = itertools.count()
        self._known: set[int] = set()         # serials of storages that existed before
        self.copies_of_known: set[int] = set()  # serials made by casting a known storage (autocast's weight copies)
        for t in known:  # storages that existed before (parameters, inputs) are never counted
            self._see(t, count=False)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._see(leaf, count=True)
        if getattr(func, "__name__", "").startswith("_to_copy") and args and isinstance(args[0], torch.Tensor) \
                and isinstance(out, torch.Tensor):
            source = self._serials.get(id(args[0].untyped_storage()))
            if source in self._known:
                self.copies_of_known.add(self._serials[id(out.untyped_storage())])
        return out

    def _see(self, tensor: torch.Tensor, *, count: bool) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        nbytes = storage.nbytes() if count else 0
        serial = self._serials.get(key)
        if serial is not None:
            if count and serial in self._sizes and nbytes != self._sizes[serial]:  # resize_ or out= grew it
                self.events.append((serial, nbytes - self._sizes[serial]))
                self._sizes[serial] = nbytes
            return
        serial = next(self._counter)
        self._serials[key] = serial
        if count:
            self._sizes[serial] = nbytes
            self.events.append((serial, nbytes))
        else:
            self._known.add(serial)
        self._refs[serial] = weakref.ref(storage, lambda _, k=key, s=serial: self._release(k, s))

    def _release(self, key: int, serial: int) -> None:
        if self._serials.get(key) == serial:
            del self._serials[key]
        self._refs.pop(serial, None)
        self._known.discard(serial)
        size = self._sizes.pop(serial, None)
        if size:
            self.events.append((serial, -size))

    def serials(self, tensors: Iterable[torch.Tensor | None]) -> set[int]:
        """Return the serials of the live storages of ``tensors`` (None entries are skipped)."""
        return {self._serials[id(t.untyped_storage())] for t in tensors
                if t is not None and id(t.untyped_storage()) in self._serials}

    def mark(self, label: str) -> None:
        """Remember the current point of the timeline as ``label``."""
        self.marks[label] = len(self.events)

    def live(self, exclude: set[int] | frozenset[int] = frozenset(), end: int | None = None) -> int:
        """Return the bytes live at ``end`` (an event index; None: now), leaving out storages in ``exclude``."""
        return sum(n for s, n in self.events[:end] if s not in exclude)

    def peak(self, exclude: set[int] | frozenset[int] = frozenset(), start: int = 0,
             end: int | None = None, only: set[int] | None = None) -> int:
        """Return the most bytes live at once between events ``start`` and ``end``, leaving out ``exclude``
        (or counting ``only`` those serials). Bytes live before ``start`` count as a base that the peak includes.
        """
        if only is not None:
            exclude = {s for s, _ in self.events if s not in only}
        level = self.live(exclude, start)
        best = level
        for serial, nbytes in self.events[start:end]:
            if serial not in exclude:
                level += nbytes
                best = max(best, level)
        return best
