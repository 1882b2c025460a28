"""The one host sync of a sampled step: every monitor's pending device tensors, copied to the host together.

On CPU the values are read at once (the plain copy). On an accelerator ``HostCopy`` starts a ``non_blocking``
copy into pinned host memory and records an event after it; when the next step is sampled too (``every=1``, the
dense start, an escalation) the watch reads the values at the end of that next step, when the device has long
finished, so the read does not drain the pipeline. The price: ``Watch.last_grads`` and the alarms lag one step
there, and an escalation after trouble (its activation hooks) starts one step later. Before a step that is not
sampled the copy is read at once: one sync in ``every`` steps. Any ``non_blocking`` device-to-host copy is read
only after its event: the tensors are first gathered on the accelerator (host-to-device and device-to-device copies
are ordered on the streams).
"""

from __future__ import annotations

import torch

from ampdoctor.core.host_reads import HostReads

__all__ = ["host_copy", "HostCopy", "DEFER", "DEFER_ON_CPU"]

# Read a sampled step's CUDA copy one step later, so that even every=1 does not drain the pipeline. The monitors
# hand their device values over when the copy starts (``pending()``), not when it is read: the step in between
# already writes new ones (a first version reset them when reading, which lost that step's loss scale).
DEFER = True
# Defer CPU copies too: the bookkeeping of the deferred read then runs without a GPU. Tests switch it on
# (tests/monitor/test_deferred_read.py: a deferred watch must see exactly what an immediate one sees).
DEFER_ON_CPU = False


class HostCopy:
    """A started copy of ``{part: {key: tensor}}`` to the host; :meth:`values` returns it as flat lists.

    The tensors are flattened and concatenated on an accelerator if any is on one, else on the CPU (float64;
    float32 on MPS, which has no float64). The copy is one read for ``reads`` (``core.host_reads``), counted when
    it starts; none when there is nothing to copy.

    >>> reads = HostReads("watch")
    >>> copy = HostCopy({"a": {"x": torch.ones(2)}, "b": {}}, reads)
    >>> copy.deferred, copy.values(), reads.count
    (False, {'a': {'x': [1.0, 1.0]}, 'b': {}}, 1)
    """

    def __init__(self, parts: dict[str, dict[str, torch.Tensor]], reads: HostReads | str = "host copy") -> None:
        self._flat = [(m, k, t) for m, d in parts.items() for k, t in d.items()]
        self._out: dict[str, dict[str, list[float]]] = {m: {} for m in parts}
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if not self._flat:
            return
        device = next((t.device for *_, t in self._flat if t.device.type != "cpu"), torch.device("cpu"))
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        joined = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for *_, t in self._flat])
        if device.type == "cuda":
            self._host = torch.empty(joined.shape, dtype=dtype, pin_memory=True)
            self._host.copy_(joined, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = joined
        (reads if isinstance(reads, HostReads) else HostReads(reads)).add()

    @property
    def syncs(self) -> int:
        """Host syncs this copy costs: 1, or 0 when there was nothing to copy."""
        return int(self._host is not None)

    @property
    def deferred(self) -> bool:
        """Whether the copy may be read a step later (CUDA), when the device is done; see ``DEFER``."""
        return DEFER and (self._event is not None or (DEFER_ON_CPU and self._host is not None))

    def values(self) -> dict[str, dict[str, list[float]]]:
        """Wait for the copy (its event, if any) and return the host values by part and key."""
        if self._host is None:
            return self._out
        if self._event is not None:
            self._event.synchronize()  # the one sync; the device finished this copy a step ago
        values = self._host.tolist()   # host memory (pinned on CUDA): the read was counted when the copy started
        offset = 0
        for m, k, t in self._flat:
            self._out[m][k] = values[offset:offset + t.numel()]
            offset += t.numel()
        self._host = self._event = None
        self._flat = []
        return self._out


def host_copy(parts: dict[str, dict[str, torch.Tensor]],
              reads: HostReads | str = "host copy") -> tuple[dict[str, dict[str, list[float]]], bool]:
    """Return the host values of ``{part: {key: tensor}}`` as flat lists (at once), and whether a sync happened.

    >>> host_copy({"a": {"x": torch.ones(2)}, "b": {}})
    ({'a': {'x': [1.0, 1.0]}, 'b': {}}, True)
    """
    copy = HostCopy(parts, reads)
    synced = bool(copy.syncs)
    return copy.values(), synced
