"""Averaged copies of the weights updated outside the optimizer (EMA, SWA) whose updates round away in fp16/bf16.

An exponential moving average moves each entry by ``(1 - decay) * (w - ema)``: with decay 0.999 that is a
thousandth of the gap between the model and its average. Stored in bf16 (8 significant bits) the step is lost
whenever it is below half an ulp of the entry, ``|ema| * 2**-9``, so a bf16 copy whose gap is under half its value
never moves: the "averaged" weights are the weights of some early step. The optimizer's own updates are measured by
`ampdoctor.monitor.updates`; this meter measures the averaged copies the same way.

Observed (pass-through, at class level, while a watch is attached): ``torch.optim.swa_utils.AveragedModel
.update_parameters(model)`` and, once diffusers is imported, ``diffusers.training_utils.EMAModel.step(parameters)``.
On a sampled call (the watch's schedule, over the calls of each averaged copy) the monitor takes up to ``sample``
entries of each fp16/bf16 averaged tensor and the same entries of the model's tensor it follows, and after the call
counts, on the device: **apart**, the entries where the copy differed from the model (an average with decay < 1
must move them), and **lost**, those of them it did not move. Nothing is read back before the summary.

A copy with decay 1 (nothing meant to move: diffusers' ``cur_decay_value == 1``) is not counted. Parameters an
``EMAModel`` copies rather than averages (``requires_grad=False``) are left out, as diffusers does. A ``step()``
given an iterable that is neither a sequence nor a module's parameter generator (a ``filter``) is not read:
consuming it would take it from diffusers; the summary says how many calls were not measured.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ampdoctor._torch.frames import generator_module
from ampdoctor.core.catalog import get_rule
from ampdoctor.core.dtypes import HALF, dtype_name
from ampdoctor.core.findings import Finding
from ampdoctor.core.host_reads import HostReads, to_host
from ampdoctor.core.patch import PatchHandle, observe
from ampdoctor.core.records import AverageCopy
from ampdoctor.core.words import counted, word_for
from ampdoctor.monitor.grad_stats import sample_index
from ampdoctor.monitor.sampling import Sampling

__all__ = ["AverageMonitor", "LOST_FRACTION"]

LOST_FRACTION = 0.5   # AMP619 when most (> half) of the sampled entries a copy had to move did not move


class _Copy:
    """One averaged copy (an ``AveragedModel`` or an ``EMAModel``): its tensors' names and the device counts."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.calls = 0            # update calls seen
        self.sampled = 0          # of them, measured
        self.unread = 0           # sampled calls whose arguments could not be read without consuming them
        self.names: list[str] = []
        self.dtypes: list[str] = []
        self.counts: torch.Tensor | None = None   # [tensors, 2]: apart, lost (summed over the sampled calls)
        self.index: dict[int, torch.Tensor] = {}  # the sampled entries of each tensor, by position


class AverageMonitor:
    """Observe the averaged copies of a run while attached; measure how many of their updates round away.

    Args:
        every: the watch's sampling period (the first calls are sampled densely, as the watch's steps are).
        sample: entries per tensor looked at on a sampled call.
        on_error: receives an exception raised inside an observer (the user's call goes on).

    >>> model = nn.Linear(64, 64).bfloat16()          # pure bf16 training, and its average in bf16
    >>> averaged = torch.optim.swa_utils.AveragedModel(
    ...     model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999))
    >>> monitor = AverageMonitor(every=50).attach()
    >>> for _ in range(4):
    ...     with torch.no_grad():
    ...         _ = model.weight.mul_(1.01)                 # a training step moves the weights by 1%
    ...     averaged.update_parameters(model)
    >>> monitor.detach()
    >>> [(c["label"], c["sampled"], c["tensors"]["weight"]) for c in monitor.summary()]
    [('AveragedModel (torch.optim.swa_utils)', 4, 0.75)]
    """

    def __init__(self, every: int = 50, *, sample: int = 4096, reads: HostReads | str = "averages",
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self._every, self.sample, self.reads, self.on_error = every, sample, reads, on_error
        self.disabled = False   # set by the owner after an internal error: the observers return at once
        self._copies: dict[int, _Copy] = {}
        self._owners: dict[int, weakref.ref] = {}   # the copies seen, while they live (for the state check)
        self._sampling: dict[int, Sampling] = {}
        self._pending: tuple[_Copy, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] | None = None
        self._handles: list[PatchHandle] = []

    # ---- attaching ------------------------------------------------------------------------------------------
    def attach(self) -> "AverageMonitor":
        """Observe ``AveragedModel.update_parameters`` (and diffusers' ``EMAModel.step`` if diffusers is loaded)."""
        from torch.optim.swa_utils import AveragedModel

        self._handles.append(observe(AveragedModel, "update_parameters", before=self._before_swa,
                                     after=self._after, on_error=self.on_error))
        self.attach_diffusers()
        return self

    def attach_diffusers(self) -> None:
        """Observe ``diffusers.training_utils.EMAModel.step`` once diffusers is imported (a no-op otherwise)."""
        cls = getattr(sys.modules.get("diffusers.training_utils"), "EMAModel", None)
        if cls is None or not callable(vars(cls).get("step")) or any(h.owner is cls for h in self._handles):
            return
        self._handles.append(observe(cls, "step", before=self._before_ema, after=self._after, on_error=self.on_error))

    def detach(self) -> None:
        """Remove the observers (last installed first); the counts stay for the summary."""
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            handle.remove()
        self._pending = None

    # ---- the observers --------------------------------------------------------------------------------------
    def _before_swa(self, averaged: Any, model: Any, *args: Any, **kwargs: Any) -> None:
        if self.disabled:
            return
        copy = self._copy(averaged, "AveragedModel (torch.optim.swa_utils)")
        if not self._sampled(averaged, copy):
            return
        module = averaged.module
        if averaged.use_buffers:
            named = [*module.named_parameters(), *module.named_buffers()]
            sources = [*model.parameters(), *model.buffers()]
        else:
            named, sources = list(module.named_parameters()), list(model.parameters())
        self._snapshot(copy, [(n, avg, src) for (n, avg), src in zip(named, sources)])

    def _before_ema(self, ema: Any, parameters: Any = None, *args: Any, **kwargs: Any) -> None:
        if self.disabled:
            return
        copy = self._copy(ema, "EMAModel (diffusers)")
        if not self._sampled(ema, copy):
            return
        sources, names = _sources(parameters)
        if sources is None:
            copy.unread += 1
            return
        pairs = [(names[k] if names else f"shadow_params[{k}]", avg, src)
                 for k, (avg, src) in enumerate(zip(ema.shadow_params, sources)) if src.requires_grad]
        self._snapshot(copy, pairs)

    def _after(self, result: Any, owner: Any, *args: Any, **kwargs: Any) -> None:
        pending, self._pending = self._pending, None
        if pending is None or getattr(owner, "cur_decay_value", None) == 1:   # decay 1: nothing was to move
            return
        copy, taken = pending
        if not taken:
            return
        with torch.no_grad():
            rows = torch.stack([torch.stack([apart.sum(), (apart & (avg.reshape(-1)[copy.index[k]] == before)).sum()])
                                .to(taken[0][1].device) for k, avg, before, apart in taken])
            counts = torch.zeros(len(copy.names), 2, dtype=torch.int64, device=rows.device)
            counts.index_add_(0, torch.tensor([k for k, *_ in taken], device=rows.device), rows)
        copy.counts = counts if copy.counts is None else copy.counts + counts

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def _copy(self, owner: Any, label: str) -> _Copy:
        copy = self._copies.get(id(owner))
        if copy is None:
            copy = self._copies[id(owner)] = _Copy(label)
            self._sampling[id(owner)] = Sampling(self._every)
            with contextlib.suppress(TypeError):   # an owner that takes no weak reference is not checked
                self._owners[id(owner)] = weakref.ref(owner)
        return copy

    def averaged_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """Return the floating tensors of the averaged copies seen so far that still live, as ``(the copy's label,
        the tensor's name, the tensor)``: an ``AveragedModel``'s parameters and buffers, an ``EMAModel``'s shadow
        parameters (``monitor.parts.state`` checks them finite)."""
        out = []
        for key, ref in list(self._owners.items()):
            owner = ref()
            if owner is None:
                continue
            label = self._copies[key].label
            module = getattr(owner, "module", None)
            named = [*module.named_parameters(), *module.named_buffers()] if isinstance(module, nn.Module) else \
                [(f"shadow_params[{k}]", t) for k, t in enumerate(getattr(owner, "shadow_params", None) or [])]
            out += [(label, name, t) for name, t in named if isinstance(t, torch.Tensor) and t.is_floating_point()]
        return out

    def _sampled(self, owner: Any, copy: _Copy) -> bool:
        copy.calls += 1
        self._pending = None
        if not self._sampling[id(owner)].sampled(copy.calls - 1):
            return False
        copy.sampled += 1
        return True

    def _snapshot(self, copy: _Copy, pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Take the sampled entries of each half-precision averaged tensor, and whether they differ from the model."""
        if not copy.names:
            copy.names = [name for name, _, _ in pairs]
            copy.dtypes = [dtype_name(avg) for _, avg, _ in pairs]
        taken = []
        with torch.no_grad():
            for k, (_, avg, src) in enumerate(pairs):
                if avg.dtype not in HALF or not avg.is_floating_point() or avg.shape != src.shape or not avg.numel():
                    continue
                index = copy.index.get(k)
                if index is None:
                    n = avg.numel()
                    index = copy.index[k] = (torch.arange(n) if n <= self.sample
                                             else sample_index(n, self.sample, k)).to(avg.device)
                before = avg.detach().reshape(-1)[index].clone()
                apart = before.float() != src.detach().reshape(-1)[index.to(src.device)].to(before.device).float()
                taken.append((k, avg, before, apart))
        self._pending = (copy, taken)

    # ---- results --------------------------------------------------------------------------------------------
    def sections(self) -> tuple[AverageCopy, ...]:
        """Return one section per averaged copy with a half-precision tensor: calls, sampled calls and, per tensor,
        the share of the sampled entries it had to move that it did not (one host read per copy)."""
        out = []
        for copy in self._copies.values():
            if copy.counts is None:
                continue
            counts = to_host(copy.counts, self.reads)
            lost = {name: round(lost / apart, 4) for name, (apart, lost) in zip(copy.names, counts) if apart}
            dtypes = {name: dtype for name, dtype in zip(copy.names, copy.dtypes) if name in lost}
            out.append(AverageCopy(copy.label, copy.calls, copy.sampled, copy.unread, sum(a for a, _ in counts),
                                   sum(v for _, v in counts), lost, dtypes))
        return tuple(out)

    def summary(self) -> list[dict[str, Any]]:
        """Return the sections of the averaged copies as data (`sections`)."""
        return [copy.to_dict() for copy in self.sections()]


def average_findings(copies: Iterable[AverageCopy]) -> list[Finding]:
    """AMP619 for each averaged copy of which most sampled entries that had to move did not."""
    rule, out = get_rule("AMP619"), []
    for copy in copies:
        lost = {name: share for name, share in copy.tensors.items() if share > LOST_FRACTION}
        if not copy.apart or copy.lost / copy.apart <= LOST_FRACTION or not lost:
            continue
        worst = sorted(lost, key=lambda name: -lost[name])
        dtypes = sorted(set(copy.dtypes[name] for name in lost))
        detail = (f"{copy.label}: {copy.lost / copy.apart:.1%} of the sampled entries that differed from "
                  f"the model did not move on {counted(copy.sampled, 'sampled update')} of {copy.calls}; "
                  f"{len(lost)} {'/'.join(dtypes)} {word_for(len(lost), 'tensor')} lost more than half, worst "
                  f"{worst[0]} ({lost[worst[0]]:.0%}): the average step (1 - decay) * (w - average) is below half "
                  "an ulp")
        out.append(rule.finding(", ".join(worst[:3]) + (" …" if len(worst) > 3 else ""), detail))
    return out


def _sources(parameters: Any) -> tuple[list[torch.Tensor] | None, list[str] | None]:
    """The tensors an ``EMAModel.step`` call averages towards, read without consuming its argument."""
    module = parameters if isinstance(parameters, nn.Module) else generator_module(parameters)
    if module is not None:
        named = list(module.named_parameters())
        return [p for _, p in named], [n for n, _ in named]
    if isinstance(parameters, (list, tuple)) and all(isinstance(p, torch.Tensor) for p in parameters):
        return list(parameters), None
    return None, None
