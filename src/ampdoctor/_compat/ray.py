"""Ray Train: whether this process is a worker of a distributed ``TorchTrainer`` fit, which Ray kills, not exits.

Ray Train (V2, the default in Ray 2.60) runs the training function in a thread of a ``RayTrainWorker`` actor;
when the fit ends it calls the actors' ``shutdown`` and ``ray.kill``s them at most 5 s later, so ``atexit`` never
runs there, and an exception of the function is caught by Ray, never reaching ``sys.excepthook``.

Nothing imports Ray: ``ray.train`` is looked for in ``sys.modules`` (a worker has imported it before it runs the
function). Only public API is used: ``ray.train.get_context()`` raises ``RuntimeError`` outside a training function,
and inside one of several processes returns a ``DistributedTrainContext`` (Ray Train's local mode, in the driver
process, returns a ``LocalTrainContext``: that process exits normally). Fallback: under Ray Train V1
(``RAY_TRAIN_V2_ENABLED=0``), whose ``get_context()`` answers in any process, or without ``get_context``, no process
reads as a worker.
"""

from __future__ import annotations

import sys


def in_train_worker() -> bool:
    """Return whether this process runs a Ray Train function as one of a distributed fit's workers.

    >>> in_train_worker()
    False
    """
    get_context = getattr(sys.modules.get("ray.train"), "get_context", None)
    if get_context is None:
        return False
    try:
        context = get_context()
    except RuntimeError:   # "cannot be used outside of a Ray Train training function"
        return False
    return type(context).__name__ == "DistributedTrainContext"
