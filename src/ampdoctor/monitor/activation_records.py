"""The device-side values of one sampled step of an ``ActivationMonitor``, and the probes that fill them.

A forward hook appends each module output's ``torch.aminmax`` pair to a :class:`StepRecord`; a :class:`GradProbe`
registered on that output (``Tensor.register_hook``) appends its gradient's pair during backward. Nothing is read
on the host until :func:`abs_max` copies every pair of a step, forward and backward, in one read.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ampdoctor._torch.autograd import version_counter
from ampdoctor._torch.scaler import live_scale
from ampdoctor.core.host_reads import HostReads, to_host

__all__ = ["StepRecord", "GradProbe", "abs_max", "abs_max_on_device", "split", "output_limit", "scale_note",
           "is_input"]



def is_input(name: str | None) -> bool:
    """Whether a step record's first non-finite "module" is a model's input: ``(input)``, or another model's
    ``(input of netG)`` (``ActivationMonitor`` with ``others``).

    >>> is_input("(input)"), is_input("(input of netG)"), is_input("netG.2"), is_input(None)
    (True, True, False, False)
    """
    return name is not None and name.startswith("(input")


class StepRecord:
    """The device-side values of one sampled step; grad probes hold this, never the monitor or the model."""

    __slots__ = ("step", "fwd", "fwd_modules", "fwd_limits", "bwd", "bwd_modules", "last", "replay", "errors",
                 "closed", "probes")

    def __init__(self, step: int, probes: bool = True) -> None:
        self.step = step
        self.probes = probes  # probe the outputs' gradients (GradProbe), or look at the forward alone
        self.fwd: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fwd_modules: list[int] = []
        self.fwd_limits: list[float | None] = []
        self.bwd: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bwd_modules: list[list[int]] = []
        self.last: tuple | None = None
        self.replay: dict[int, Any] = {}  # each root's call's Replay (ampdoctor.monitor.replay), until recorded
        self.errors: list[BaseException] = []
        self.closed = False

    def add_output(self, index: int, t: torch.Tensor) -> None:
        """Keep the (min, max) of module ``index``'s floating-point output ``t``, and probe its gradient."""
        version = version_counter(t)
        last = self.last
        if last is not None and last[0] is t and version is not None and last[1] == version:
            pair, probe = last[2], last[3]  # a container returning its child's output: measured already
        else:
            pair = torch.aminmax(t.detach())  # one pass, no copy; NaN and inf propagate into min/max
            probe = None
            # a leaf (a module returning its own Parameter) would keep the hook for good: not probed
            if self.probes and t.requires_grad and t.grad_fn is not None:
                probe = GradProbe(self)
                t.register_hook(probe)
            self.last = (t, version, pair, probe)
        self.fwd.append(pair)
        self.fwd_modules.append(index)
        self.fwd_limits.append(output_limit(t))
        if probe is not None:
            probe.modules.append(index)


class GradProbe:
    """A ``Tensor.register_hook`` callback: keep the gradient's min/max on the device, return None."""

    __slots__ = ("record", "modules")

    def __init__(self, record: StepRecord) -> None:
        self.record = record
        self.modules: list[int] = []  # the modules that returned this tensor, innermost first

    def __call__(self, grad: torch.Tensor) -> None:
        rec = self.record
        if rec.closed:
            return None
        try:
            if grad.is_floating_point() and grad.numel():
                rec.bwd.append(torch.aminmax(grad.detach()))
                rec.bwd_modules.append(self.modules)
        except Exception as exc:  # raising here would break the user's backward()
            rec.errors.append(exc)
        return None


def abs_max(*groups: list[tuple[torch.Tensor, torch.Tensor]],
            reads: HostReads | str = "activations") -> list[list[float]]:
    """Return max(|min|, |max|) of each (min, max) pair of each group, all copied to the host in one read.

    >>> abs_max([torch.aminmax(torch.tensor([-3.0, 1.0]))], [], [torch.aminmax(torch.tensor([2.0]))])
    [[3.0], [], [2.0]]
    """
    device_values = abs_max_on_device(*groups)
    return split(groups, [] if device_values is None else to_host(device_values, reads))


def abs_max_on_device(*groups: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """Return max(|min|, |max|) of every (min, max) pair of the groups, in order, as one float32 tensor on a device
    (None without pairs): what :func:`abs_max` reads, for an owner that copies it with its own values."""
    # DTensor results (DTensor modules): this rank's local values, no communication
    flat = [x.to_local() if hasattr(x, "to_local") else x for pairs in groups for pair in pairs for x in pair]
    if not flat:
        return None
    try:
        stacked = torch.stack(flat)
    except RuntimeError:  # values on several devices (pipeline or model parallel): gathered on one of them first
        device = next((x.device for x in flat if x.device.type != "cpu"), flat[0].device)
        stacked = torch.stack([x.to(device) for x in flat])
    return stacked.float().abs().view(-1, 2).amax(dim=1)


def split(groups: tuple[list[Any], ...], values: list[float]) -> list[list[float]]:
    """Cut the host values of :func:`abs_max_on_device` back into one list per group."""
    out, start = [], 0
    for pairs in groups:
        out.append(values[start:start + len(pairs)])
        start += len(pairs)
    return out


@functools.lru_cache(maxsize=None)
def _finfo_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def output_limit(t: torch.Tensor) -> float | None:
    """Return the largest value ``t`` can hold where it is going: its own dtype's, or autocast's if lower."""
    limit = _finfo_max(t.dtype) if t.itemsize < 4 else None
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):  # an fp32 output is cast to the autocast dtype by the next op
        cast = _finfo_max(torch.get_autocast_dtype(device_type))
        limit = cast if limit is None else min(limit, cast)
    return limit


def scale_note(scaler: Any, reads: HostReads | str = "activations") -> str:
    """Return the sentence that says gradients seen by the hooks carry the loss scale (and its value: one read)."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return " Gradients seen here are multiplied by the loss scale, if a GradScaler is used."
    scale = live_scale(scaler)   # what get_scale() reads, or its init_scale before the first scale()
    value = to_host(scale, reads) if scale is not None else scaler.get_scale()
    return f" Gradients seen here are multiplied by the GradScaler's scale ({value:g} now)."
