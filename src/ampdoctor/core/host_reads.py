"""Every device-to-host read ampdoctor makes, counted for its owner: how often ampdoctor makes the host wait.

A read copies a tensor to the host (``to_host``), and the host waits for the device to finish everything queued
before it: on an accelerator that stalls the pipeline, so the monitors keep their values on the device and read them
in batches. Each read is counted for its owner, a ``HostReads`` (a watch, one of its monitors, the guard), and for
the owner that one belongs to (``within``: the activation monitor's reads are the watch's too), and in the process
totals by owner name (``process_reads()``). Reads of CPU tensors are counted as well: the count is what the same
run costs on an accelerator. A batched copy that does its own transfer (``monitor.host_sync.HostCopy``'s pinned,
non-blocking copy) counts itself with ``HostReads.add``.

>>> reads = HostReads("watch")
>>> to_host(torch.tensor([1.0, 2.0]), HostReads("activations", within=reads)), reads.count
([1.0, 2.0], 1)
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

__all__ = ["HostReads", "to_host", "process_reads"]

_TOTALS: collections.Counter[str] = collections.Counter()
_LOCK = threading.Lock()   # the autograd engine's threads run hooks too


class HostReads:
    """The device-to-host reads made for one owner, and through it for the owners it belongs to.

    Args:
        owner: who reads, as the process totals name it (``"watch"``, ``"activations"``, ``"guard"``).
        within: the owner this one is part of; each read counts there too.

    >>> guard = HostReads("guard")
    >>> guard.add(); guard.count
    1
    """

    def __init__(self, owner: str, within: HostReads | None = None) -> None:
        self.owner, self.within = owner, within
        self.count = 0

    def add(self, reads: int = 1) -> None:
        """Count ``reads`` reads made for this owner (and the owners it is within)."""
        with _LOCK:
            _TOTALS[self.owner] += reads
            counter: HostReads | None = self
            while counter is not None:
                counter.count += reads
                counter = counter.within

    def __repr__(self) -> str:
        return f"HostReads({self.owner!r}, count={self.count})"


def to_host(tensor: torch.Tensor, owner: HostReads | str) -> Any:
    """Copy ``tensor`` to the host as Python values (``tensor.tolist()``: a number for a 0-d tensor) and count one
    read for ``owner`` (a ``HostReads``, or a name for a read no counter follows: a crash explanation's).

    Batch what one place needs into one tensor first (``torch.stack``, ``torch.cat``): each call is one wait.

    >>> to_host(torch.tensor(2.5), "explanations")
    2.5
    """
    counter = owner if isinstance(owner, HostReads) else HostReads(owner)
    counter.add()
    return tensor.tolist()


def process_reads() -> dict[str, int]:
    """Return the reads made in this process so far, by owner name.

    >>> to_host(torch.ones(1), "doctest"); process_reads()["doctest"] >= 1
    [1.0]
    True
    """
    with _LOCK:
        return dict(_TOTALS)
