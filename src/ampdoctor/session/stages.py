"""Which objects a run trains now: its stages, and what the earlier ones left behind, in one place.

A run's objects change while it runs. A k-fold builds a model and an optimizer per fold, a resume builds them again,
a notebook's re-run cell rebuilds them, a second training stage (a fine-tune after a pre-train) steps new ones. The
ended stages' objects may stay alive (the script's list of folds, IPython's traceback of a crashed cell), yet they are
not what trains now. `Stages` keeps, for one run:

* the watch's stage: the optimizers there were when the watch began following one, and when newer optimizers step
  ``after`` times while the watched one does not, the next stage (`Stages.stepped`); the ended stage's watch summary
  (steps, sampled steps, what was verified) is kept for the report (`Stages.summaries`);
* the optimizers of the stages the watch left that did not step on into the next (``left``), which the next
  stage's watch leaves out;
* the optimizers and GradScalers discovery handed over (``diagnosed``), and those of ended stages discovery leaves
  out until they train again (``ended``, shared with the stages before and after: a notebook's doctors);
* the models that ran a forward with nothing to train (a frozen teacher, a VAE), whose forward the watch looks at.

Everything here is held weakly: a stage that ended must not keep the user's objects alive.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Sequence

from torch import nn

from ampdoctor.core.records import StageSummary, WatchSummary
from ampdoctor.core.training import unwrap_optimizer

__all__ = ["Stages", "STAGE_AFTER", "MAX_FROZEN"]

STAGE_AFTER = 3   # steps of newer optimizers, with none of the watched one, that start the watch's next stage
MAX_FROZEN = 8    # frozen models (a teacher, a VAE, a text encoder) whose forward the watch's look covers


class Stages:
    """The stages of one run; see the module's description.

    Args:
        after: steps of newer optimizers (with none of the watched one) that start the next stage: 1 in a notebook,
            where a re-run cell rebuilds them.
        ended: the optimizers and GradScalers of ended stages that discovery leaves out until they train again;
            shared, not copied (a notebook's doctors share one).

    >>> import torch
    >>> stages = Stages(after=2)
    >>> old, new = (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1) for _ in range(2))
    >>> stages.begin([old])
    >>> [stages.stepped(new, watched=False, known=lambda: True) for _ in range(2)]
    [False, True]
    """

    def __init__(self, after: int = STAGE_AFTER, ended: weakref.WeakSet | None = None) -> None:
        self.after = after
        self.ended: weakref.WeakSet = ended if ended is not None else weakref.WeakSet()
        self.summaries: list[StageSummary] = []   # the watch summaries of the stages a later one replaced
        self.diagnosed: weakref.WeakSet = weakref.WeakSet()   # real optimizers the pre-flight has looked at
        self.scalers: weakref.WeakSet = weakref.WeakSet()     # the GradScalers the looks handed over
        self._watched: set[int] = set()   # the optimizers there were when the watch's stage began, by id
        self._recent: weakref.WeakSet = weakref.WeakSet()   # the optimizers that stepped since the watched one did
        self._others_stepped = 0          # steps of newer optimizers since the watched one last stepped
        # the optimizers of the stages the watch left that did not step on into the next (a k-fold's earlier folds)
        self._left: weakref.WeakSet = weakref.WeakSet()
        # models that ran a forward without training (a frozen teacher, a VAE under no_grad), by id, weakly
        self._frozen: dict[int, weakref.ref] = {}

    # ---- the watch's stage ----------------------------------------------------------------------------------------
    def current(self, optimizers: Sequence[Any]) -> list[Any]:
        """Return the stage's optimizers among ``optimizers``: not those of the stages the watch left, which the
        setup may still hold (a k-fold's earlier folds), unless one of them steps on."""
        return [o for o in optimizers if unwrap_optimizer(o) not in self._left]

    def has_left(self) -> bool:
        """Whether the watch left an earlier stage whose optimizers are still alive."""
        return bool(self._left)

    def begin(self, optimizers: Iterable[Any]) -> None:
        """The watch's stage begins with ``optimizers`` (the stage's, `current`)."""
        self._watched = {id(unwrap_optimizer(o)) for o in optimizers}

    def stepped(self, optimizer: Any, watched: bool, known: Callable[[], bool]) -> bool:
        """Count one step of ``optimizer`` (O(1)); return whether the watch's next stage begins now: optimizers
        diagnosed after the watched one stepped ``after`` times while it did not.

        Args:
            optimizer: the torch optimizer that stepped.
            watched: it is the one the watch follows.
            known: returns whether it is one of the run's optimizers (diagnosed): a stage is made of those (asked
                only for one the watch's stage did not have).
        """
        if watched:
            self._others_stepped = 0
            self._recent.clear()
            return False
        self._recent.add(unwrap_optimizer(optimizer))
        if id(optimizer) in self._watched or not known():
            return False   # one the watch's stage already had (a GAN's other optimizer, one optimizer per parameter)
        self._others_stepped += 1
        if self._others_stepped < self.after:
            return False
        self._others_stepped = 0
        return True

    def end(self, optimizers: Iterable[Any], summary: WatchSummary | None) -> None:
        """End the watch's stage: of the run's ``optimizers``, the stage's that did not step since are left behind
        (the next stage's watch leaves them out); keep ``summary``, the ended watch's, for the report."""
        for real in map(unwrap_optimizer, optimizers):
            if id(real) in self._watched and real not in self._recent:
                self._left.add(real)
        for real in self._recent:
            self._left.discard(real)
        self._recent.clear()
        if summary is not None:
            self.summaries.append(StageSummary(summary.steps, summary.sampled_steps, summary.verified))

    def left_behind(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` belongs to a stage the watch left."""
        return unwrap_optimizer(optimizer) in self._left

    # ---- what discovery handed over -------------------------------------------------------------------------------
    def handed_over(self, optimizers: Iterable[Any], scaler: Any) -> None:
        """Note what one look of discovery handed to the session: its optimizers and its GradScaler."""
        self.diagnosed.update(optimizers)
        if scaler is not None:
            self.scalers.add(scaler)

    def objects(self) -> list[Any]:
        """Return the optimizers and GradScalers handed over: what a notebook's next stage leaves out (``ended``)
        when a cell rebuilt them or crashed."""
        return [*self.diagnosed, *self.scalers]

    def trains_again(self, *objects: Any) -> None:
        """An ended stage's optimizer or GradScaler steps or scales again: it is this stage's."""
        for obj in objects:
            self.ended.discard(obj)

    # ---- frozen models ----------------------------------------------------------------------------------------------
    def note_frozen(self, module: nn.Module) -> bool:
        """Remember a model whose forward ran with nothing to train (O(1) once known; at most MAX_FROZEN); return
        whether it is new."""
        if id(module) in self._frozen or len(self._frozen) >= MAX_FROZEN or next(module.parameters(), None) is None:
            return False
        self._frozen[id(module)] = weakref.ref(module)
        return True

    def frozen_models(self) -> list[nn.Module]:
        """Return the live models that ran a forward with nothing to train, in the order they first ran."""
        alive = [(key, ref()) for key, ref in self._frozen.items()]
        for key, model in alive:
            if model is None:   # collected: its id may be reused by another module
                del self._frozen[key]
        return [model for _, model in alive if model is not None]
