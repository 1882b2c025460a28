"""A ``TorchDispatchMode`` that counts the ATen ops run inside it, by name: the deterministic measure of a hot path
that the tests pin instead of timings."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """Count the ATen ops dispatched inside the mode, by name, in ``ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
