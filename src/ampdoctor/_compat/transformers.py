"""transformers internals: the Trainer that is calling a callback or holds an Accelerator, and the method that runs
one of its epochs.

A ``TrainerCallback`` is handed no Trainer (transformers 5.x): ``CallbackHandler.call_event`` is called by the
Trainer's own methods, so the Trainer is the ``self`` of a calling frame. Without ``transformers.Trainer`` loaded,
or when no calling frame holds one, the answer is None and the callback observes nothing on the Trainer.
A run that finds only the objects (``ampdoctor run``'s discovery) reaches the Trainer from its Accelerator, which
the Trainer builds and keeps in ``trainer.accelerator``: the objects that refer to the Accelerator (``gc``), an
instance ``__dict__`` standing for its owner. None when transformers is not loaded or no Trainer holds it.
``Trainer._run_epoch`` runs one epoch (an exception raised anywhere in it passes through it); without it the
callback observes ``training_step``, which sees only exceptions raised in a step.
"""

from __future__ import annotations

import gc
import sys
from typing import Any


def calling_trainer(depth: int = 16) -> Any:
    """Return the ``transformers.Trainer`` whose method is (indirectly) calling the caller, or None.

    >>> calling_trainer() is None
    True
    """
    trainer_class = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_class is None:
        return None
    frame = sys._getframe(1)
    for _ in range(depth):   # on_train_begin <- call_event <- on_train_begin (handler) <- _inner_training_loop
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, trainer_class):
            return candidate
        frame = frame.f_back
    return None


def trainer_of(accelerator: Any) -> Any:
    """Return the ``transformers.Trainer`` that holds ``accelerator`` (the one it built), or None.

    One ``gc.get_referrers`` query, and one more per instance ``__dict__`` that refers to it: a look made once per
    run, not per step.

    >>> trainer_of(None) is None
    True
    """
    trainer_class = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_class is None or accelerator is None:
        return None
    for ref in gc.get_referrers(accelerator):
        for owner in gc.get_referrers(ref) if isinstance(ref, dict) else [ref]:
            if isinstance(owner, trainer_class):
                return owner
    return None


def epoch_method(trainer: Any) -> str:
    """Return the name of the Trainer method that an exception of an epoch passes through (``training_step`` when
    this transformers has no ``_run_epoch``).

    >>> epoch_method(object())
    'training_step'
    """
    return "_run_epoch" if callable(getattr(trainer, "_run_epoch", None)) else "training_step"
