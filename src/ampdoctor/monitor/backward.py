"""Every backward of a run: the loss it was given, and the iterations whose gradients were dropped unused.

``BackwardMonitor`` observes ``torch.autograd.backward`` (``Tensor.backward`` calls it, and so do accelerate,
Lightning, DeepSpeed and the Trainer), pass-through. Per call it does O(1) host work:

* **the loss**: on a sampled step the value given to backward is copied on the device, divided by the GradScaler's
  scale when it is the tensor ``scaler.scale`` returned, or by the constant (``HAND_SCALE`` or more) a hand-written
  loss scaler multiplied it by (``loss * 2**lg_loss_scale``, read from the graph node; any constant equal to the
  scale of the library's loss scaler the watch follows, which goes below 1: fairseq's); the step's last
  one is the step line's loss.
* **dropped iterations**: a probe parameter (the first watched one that had a gradient) tells whether a backward
  reached the watched parameters (its ``.grad`` changed). Gradients a backward wrote are dropped when they are
  reset before an optimizer step used them. ``Optimizer.zero_grad`` and ``Module.zero_grad`` are observed
  (pass-through, process-wide like ``torch.autograd.backward``): the watched optimizer's or model's, when it
  changes the probe's gradient (set to None or zeroed in place) after a backward and outside a step, discards
  them (a layer's own zero_grad() may only freeze that layer). When the optimizer step follows, it
  had no gradient to use: zero_grad() between backward() and step() (``zeroed_before_step``); when the next
  backward follows, the iteration was skipped (a hand-written loss scaler). A reset by other means is seen when
  the next backward starts with no step in between: on the host (None, a new tensor), or, changed in place,
  checked for all-zero on the device and read at the next sampled step, so no step syncs (a gradient set to None
  before a step proves nothing: engines move it out themselves, ZeRO into its partitions). Gradient accumulation
  leaves the gradient alone and is not counted; the backward calls of a ``step(closure)`` (LBFGS evaluates it
  several times) are the step's own. Under ``ampdoctor.MasterWeights`` the probe's gradient is the fp32 sum the
  wrapper holds aside between micro-batches (``repairs.master_weights.accumulating_grad``), not the zeroed half
  placeholder it puts in ``.grad`` for the next backward: the placeholder is not a reset. Another optimizer's step
  after a backward used it (a GAN's generator backward also writes the discriminator's gradients, which the next
  ``netD.zero_grad()`` resets): torch's global optimizer step post-hook says so. The backward calls since the last
  step, with no step after them yet, are ``unstepped``: the loop ended (or crashed) before a step used them.

* **every loss, when asked** (``count_every_loss``): where the run's log leaves inf/NaN losses out (the transformers
  Trainer's ``logging_nan_inf_filter``), every loss given to backward, sampled or not, is checked for inf/NaN on the
  device (a count and the first step with one), and read in the sampled steps' copies: AMP610.

A GradScaler's skipped step ends the step (``scaler.update()``): those skips are the ``ScaleMonitor``'s to count.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ampdoctor._torch.autograd import constant_factor, version_counter
from ampdoctor._torch.scaler import live_scale
from ampdoctor.core.patch import PatchHandle, observe
from ampdoctor.core.records import LossSummary, loss_entry
from ampdoctor.core.records.summary import EveryLoss
from ampdoctor.monitor.grad_stats import local_tensor
from ampdoctor.repairs.master_weights import accumulating_grad

__all__ = ["BackwardMonitor", "LOSS_HISTORY", "HAND_SCALE"]

LOSS_HISTORY = 10_000   # sampled losses kept
HAND_SCALE = 16.0       # loss * c with a constant c at least this: a hand-written loss scale, not a loss weight


class BackwardMonitor:
    """Count the backward calls and the dropped ones; keep the loss of sampled steps.

    Args:
        params: the watched parameters (the probe is the first of them with a gradient).
        scaler: the run's GradScaler, if any: a loss it scaled is divided by its scale.
        library_scale: returns the scale of the library's own loss scaler the watch follows (fairseq's, ...), if
            any: a loss multiplied by a constant equal to it is divided by it.
        on_error: called with an exception raised in an observer (the user's backward still runs).
        owners: the watched optimizer (and its wrappers) and model: their ``zero_grad()`` resets every watched
            gradient. Another's (a layer's, to freeze it) may reset the probe's alone: it is not counted.
    """

    def __init__(self, params: Sequence[torch.Tensor], scaler: Any = None,
                 on_error: Callable[[BaseException], None] | None = None, owners: Sequence[Any] = (),
                 library_scale: Callable[[], Any] | None = None) -> None:
        self._params = [p for p in params if p.requires_grad]
        self._owners = list(owners)
        self._scaler = scaler
        self._library_scale = library_scale
        self.on_error = on_error
        self.sampling = False
        self.disabled = False   # set after an internal error: the observers stay (removed in order on detach)
        self._handles: list[PatchHandle | torch.utils.hooks.RemovableHandle] = []
        self._probe: torch.Tensor | None = None
        self._mark: tuple[int, int] | None = None    # the probe's gradient (id, version) after the last backward
        self._entering: tuple[int, int] | None = None  # ... when the backward under way started
        self._unstepped = 0      # backward calls that reached the probe since the last step ended
        self._discarded = 0      # of those, the ones a zero_grad() reset since the last backward: not counted yet
        self._in_step = False    # an optimizer step is under way (a step(closure)'s backward calls are its own)
        self._zero_state: tuple[int, int] | None = None   # the probe's gradient as the last zero_grad() started
        self.step_discarded = False   # the step under way found the gradients of its backward calls reset
        self._scaled: tuple[int, torch.Tensor] | None = None   # id of scaler.scale's last output, and its scale
        self._value: torch.Tensor | None = None      # the sampled step's last loss, on the device
        self._zeroed: torch.Tensor | None = None     # [dropped, dropped before the first step]: in-place zeroing
        self.steps_ended = 0
        self.backwards = 0       # every backward call seen
        self.dropped = 0         # of those, dropped (the device-counted ones are added at consume)
        self.dropped_early = 0   # dropped before the first step ended (calibration of a hand-written scaler)
        self.zeroed_before_step = 0   # dropped by a zero_grad() between backward() and the step that followed
        self._since = 0          # backward calls since the last step line
        self._dropped_since = 0
        self._handed = (0, 0)    # (_since, _dropped_since) as pending() handed them over
        self.losses: list[tuple[int, float]] = []   # (sampled step, loss), up to LOSS_HISTORY
        self.hand_scaled = False   # a loss given to backward was multiplied by a loss scale of its own
        self.hidden_by: str | None = None   # count_every_loss: what leaves the inf/NaN losses out of the log
        self._every: torch.Tensor | None = None   # [inf/NaN losses, first step with one (-1: none)], on the device
        self.every = {"losses": 0, "nonfinite": 0, "first": None}   # of every loss counted, as read so far

    def attach(self) -> "BackwardMonitor":
        """Observe ``torch.autograd.backward`` (and ``scaler.scale``); return ``self``."""
        if not self._handles and self._params:
            self._handles.append(observe(torch.autograd, "backward", before=self._before, after=self._after,
                                         on_error=self.on_error))
            for owner in (torch.optim.Optimizer, torch.nn.Module):   # the classes: copies of a model stay plain
                self._handles.append(observe(owner, "zero_grad", before=self._before_zero_grad,
                                             after=self._after_zero_grad, on_error=self.on_error))
            self._handles.append(register_optimizer_step_post_hook(self._after_any_step))
            if self._scaler is not None:
                self._handles.append(observe(self._scaler, "scale", after=self._after_scale,
                                             on_error=self.on_error))
        return self

    def count_every_loss(self, hidden_by: str) -> None:
        """Also check every loss given to backward for inf/NaN, not only the sampled steps' (a few device ops per
        backward, read with the sampled steps' copies); ``hidden_by`` names what keeps them out of the run's log."""
        self.hidden_by = hidden_by

    def detach(self) -> None:
        """Remove the observers (last installed first) and drop the references; the counts stay."""
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            try:
                handle.remove()
            except Exception:
                pass
        self._params, self._probe, self._scaler, self._scaled, self._owners = [], None, None, None, []
        self._library_scale = None

    # ---- observers: host work, and one device op when a gradient was changed in place -------------------------
    def _after_scale(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if self.disabled:
            return
        scale = live_scale(self._scaler)
        if isinstance(result, torch.Tensor) and scale is not None:
            self._scaled = (id(result), scale)

    def _before(self, tensors: Any, *args: Any, **kwargs: Any) -> None:
        if self.disabled:
            return
        self.backwards += 1
        self._since += 1
        if not self._in_step:   # a step(closure)'s evaluations are the step's own
            if self._discarded:   # zeroed, then another backward and no step: a skipped iteration
                n, self._discarded = self._discarded, 0
                self._count(n)
            self._note_reset()
        self._entering = self._state()
        loss = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else tensors
        if self.hidden_by is not None and isinstance(loss, torch.Tensor):
            self._count_nonfinite(loss)
        if self.sampling and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            with torch.no_grad():
                value = local_tensor(loss.detach())   # a DTensor loss (FSDP2, tensor parallel): replicated
                if value is None:
                    return
                value = value.reshape(1).float()
                if self._scaled is not None and self._scaled[0] == id(loss):
                    value = value / self._scaled[1].to(value.device)
                else:   # a hand-written loss scaler: loss * 2**k with k a Python number
                    factor = constant_factor(loss)
                    if factor is not None and (factor >= HAND_SCALE or factor == self._library()):
                        value, self.hand_scaled = value / factor, True
                self._value = value.clone()

    def _library(self) -> float | None:
        """The scale of the library's loss scaler the watch follows, when it is a Python number."""
        scale = self._library_scale() if self._library_scale is not None else None
        return scale if isinstance(scale, float) else None

    def _count_nonfinite(self, loss: torch.Tensor) -> None:
        with torch.no_grad():
            value = local_tensor(loss.detach())
            if value is None:
                return
            bad = (~torch.isfinite(value)).any().to(torch.float64)
            step = float(self.steps_ended)
            every = None if self._every is None else self._every.to(bad.device)
            if every is None:
                self._every = torch.stack([bad, torch.where(bad > 0, step, -1.0)])
            else:
                self._every = torch.stack([every[0] + bad, torch.where((every[1] < 0) & (bad > 0), step, every[1])])
        self.every["losses"] += 1

    def _after(self, result: Any, *args: Any, **kwargs: Any) -> None:
        if self.disabled:
            return
        now = self._state()
        if now is not None and now != self._entering:   # this backward wrote the probe's gradient
            self._unstepped += 1
            self._mark = now

    def _before_zero_grad(self, owner: Any, *args: Any, **kwargs: Any) -> None:
        if not self.disabled and self._unstepped and not self._in_step and any(owner is o for o in self._owners):
            self._zero_state = self._state()

    def _after_zero_grad(self, result: Any, *args: Any, **kwargs: Any) -> None:
        """A zero_grad() that reset the probe's gradient after a backward, outside a step, discards that backward's
        gradients (counted when the step or the next backward says which it was)."""
        before, self._zero_state = self._zero_state, None
        if self.disabled or before is None or not self._unstepped or self._state() == before:
            return
        self._discarded += self._unstepped
        self._unstepped, self._mark = 0, None

    def _after_any_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Any optimizer's step ended (torch's global post-hook): the backward calls before it were used, whichever
        weights it updated (the watched optimizer's own step ends at ``step_ended``)."""
        try:
            if not self.disabled and not self._in_step:
                self._discarded, self._unstepped, self._mark = 0, 0, None
        except Exception as exc:   # never the user's step
            if self.on_error is not None:
                self.on_error(exc)

    def step_started(self) -> None:
        """The watched optimizer's step starts (``scaler.step()`` or the optimizer's own): count the backward calls
        whose gradients were reset before it, which it has none of to use (``step_discarded``)."""
        if self.disabled or self._in_step:
            return
        self._in_step = True
        # only a zero_grad() says so: engines move .grad out between backward and step themselves (ZeRO's
        # partitions, Megatron's main_grad buffers), so a probe gradient that is None now proves nothing
        n, self._discarded = self._discarded, 0
        self.step_discarded = n > 0
        if n:   # not a skipped iteration (no calibration): a step that had no gradient to use
            self.dropped += n
            self._dropped_since += n
            self.zeroed_before_step += n

    def _state(self) -> tuple[int, int] | None:
        if self._probe is None:
            self._probe = next((p for p in self._params if p.grad is not None), None)
        g = self._probe_grad()
        return None if g is None else (id(g), version_counter(g))

    def _probe_grad(self) -> torch.Tensor | None:
        """Return the probe's gradient as backward accumulates it (a MasterWeights' held fp32 sum: see above)."""
        return None if self._probe is None else accumulating_grad(self._probe)

    def _note_reset(self) -> None:
        """A backward starts: was the gradient the earlier ones wrote reset with no step in between?"""
        mark = self._mark
        if not self._unstepped or mark is None:
            return
        g = self._probe_grad()
        if g is not None and (id(g), version_counter(g)) == mark:
            return   # untouched: this backward accumulates into it
        n, self._unstepped, self._mark = self._unstepped, 0, None
        if g is None or id(g) != mark[0]:
            self._count(n)
            return
        with torch.no_grad():   # changed in place: zeroed (dropped), or only modified (not counted)
            zero = (g == 0).all().to(torch.float32) * n
            row = torch.stack([zero, zero * float(self.steps_ended == 0)])
            self._zeroed = row if self._zeroed is None else self._zeroed + row.to(self._zeroed.device)

    def _count(self, n: int) -> None:
        self.dropped += n
        self._dropped_since += n
        if self.steps_ended == 0:
            self.dropped_early += n

    def step_ended(self) -> None:
        """An optimizer step (or a GradScaler's skipped one) ended: the gradients were used."""
        self.steps_ended += 1
        self._in_step = self.step_discarded = False
        # a GradScaler's skipped step used them too: its decision (zero_grad() before update() is ordinary then)
        self._discarded, self._unstepped, self._mark = 0, 0, None

    # ---- the owner's sync ------------------------------------------------------------------------------------
    def pending(self) -> dict[str, torch.Tensor]:
        """Hand over the sampled step's loss and the in-place drops counted on the device since the last call."""
        out: dict[str, torch.Tensor] = {}
        # the host counts of this step line, kept with its copy (read at the next step on CUDA)
        self._handed = (self._since, self._dropped_since)
        self._since = self._dropped_since = 0
        if self._value is not None:
            out["loss"], self._value = self._value, None
        if self._zeroed is not None:
            out["zeroed"], self._zeroed = self._zeroed, None
        if self._every is not None:
            out["every"], self._every = self._every, None
        return out

    def consume(self, values: dict[str, list[float]], step: int, partial: bool = False) -> dict[str, Any] | None:
        """Take the host values of ``pending()``; return the step line's ``loss`` entry (None without a loss).
        ``partial``: read at detach, in a step that never ended; its loss is not one of a step's."""
        zeroed = values.get("zeroed")
        (since, dropped), self._handed = self._handed, (0, 0)
        if zeroed:
            self.dropped += int(zeroed[0])
            self.dropped_early += int(zeroed[1])
            dropped += int(zeroed[0])
        every = values.get("every")
        if every:
            self.every["nonfinite"] += int(every[0])
            if self.every["first"] is None and every[1] >= 0:
                self.every["first"] = int(every[1])
        loss = values.get("loss")
        if not loss or partial:
            return None
        if len(self.losses) < LOSS_HISTORY:
            self.losses.append((step, loss[0]))
        return loss_entry(loss[0], since, dropped)

    def section(self, nonfinite_forward: Sequence[tuple[int, str | None]] = ()) -> LossSummary:
        """Return the counts and what the sampled losses did (``monitor.verdicts`` reads it). ``unstepped``: the
        backward calls since the last step, with no step after them (yet): the loop ended before one used them;
        ``dropped`` includes those a zero_grad() discarded that no step or backward has followed yet.
        ``nonfinite_forward``: what the owner saw of the forward of steps with an inf/NaN loss."""
        losses = {}
        if self.losses:
            finite = [(s, v) for s, v in self.losses if math.isfinite(v)]
            losses = dict(nonfinite=tuple(s for s, v in self.losses if not math.isfinite(v))[:20],
                          last_finite=math.isfinite(self.losses[-1][1]),
                          identical=tuple(_longest_identical(self.losses)))
            if finite:
                head = finite[:max(1, len(finite) // 4)]
                losses.update(first=finite[0], last=finite[-1], head_min=min(v for _, v in head),
                              peak=max(finite, key=lambda sv: sv[1]))
        every = None if self.hidden_by is None else EveryLoss(self.every["losses"], self.every["nonfinite"],
                                                              self.every["first"], self.hidden_by)
        return LossSummary(self.backwards, self.dropped + self._discarded, self.dropped_early, self.steps_ended,
                           self.zeroed_before_step, self._unstepped, len(self.losses), self.hand_scaled, every=every,
                           nonfinite_forward=tuple(nonfinite_forward), **losses)

    def summary(self) -> dict[str, Any]:
        """Return the counts and what the sampled losses did, as data (`section`)."""
        return self.section().to_dict()


def _longest_identical(losses: Sequence[tuple[int, float]]) -> list[Any]:
    """Return ``[length, first step, last step, value]`` of the longest run of bit-identical sampled losses.

    >>> _longest_identical([(0, 1.0), (1, 0.5), (2, 0.5), (3, 0.5), (4, 0.2)])
    [3, 1, 3, 0.5]
    """
    best, start = [1, losses[0][0], losses[0][0], losses[0][1]], 0
    for k in range(1, len(losses)):
        if losses[k][1] != losses[k - 1][1]:
            start = k
        elif k - start + 1 > best[0]:
            best = [k - start + 1, losses[start][0], losses[k][0], losses[k][1]]
    return best
