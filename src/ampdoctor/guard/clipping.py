"""Which optimizer's gradients a clipping call clips, told from its ``parameters`` argument alone.

The argument is never consumed: a ``model.parameters()`` generator is traced back to its module through its frame
(`ampdoctor._torch.frames`), and a list is looked at up to its first few tensors. Parameter ids are cached per
optimizer (refreshed when its parameter count changes) and per module, so this costs a set lookup per call.
"""

from __future__ import annotations

from types import GeneratorType
from typing import Any, Iterable

import torch

from ampdoctor._torch.frames import generator_module

_PEEK = 64             # tensors of a clip_grad_norm_ argument looked at
# the public functions that clip given parameters (observed where torch.nn.utils and its clip_grad module hold them)
CLIP_FUNCTIONS = ("clip_grad_norm_", "clip_grads_with_norm_", "clip_grad_value_")
_LIMIT = {"clip_grad_value_": "clip_value"}  # the argument after the parameters; "max_norm" for the others


def clip_call(name: str, args: tuple, kwargs: dict) -> str:
    """Say which clip ran with which limit: ``clip_grad_value_(clip_value=1.0)``.

    >>> clip_call("clip_grad_norm_", (1.0,), {}), clip_call("clip_grad_value_", (), {"clip_value": 0.5})
    ('clip_grad_norm_(max_norm=1.0)', 'clip_grad_value_(clip_value=0.5)')
    """
    limit = _LIMIT.get(name, "max_norm")
    return f"{name}({limit}={args[0] if args else kwargs.get(limit, '?')})"


class ClipOwners:
    """Find the optimizer whose parameters a ``clip_grad_norm_`` call clips, with cached parameter ids."""

    def __init__(self) -> None:
        self._param_ids: dict[int, tuple[int, frozenset[int]]] = {}
        self._module_owners: dict[int, frozenset[int]] = {}

    def owner(self, parameters: Any, ready: list[Any], all_ready: bool, known: list[Any]) -> Any:
        """Return the optimizer of ``ready`` whose parameters are being clipped, or None.

        Args:
            parameters: the first argument of ``clip_grad_norm_``.
            ready: the known optimizers not unscaled or stepped yet in this iteration.
            all_ready: whether ``ready`` holds every known optimizer; an argument that cannot be traced is then
                taken to be the first one's.
            known: every known optimizer, to find the owners of a module once.
        """
        if isinstance(parameters, GeneratorType):
            module = generator_module(parameters)
            if module is None:
                return ready[0] if all_ready else None
            owners = self._module_owners.get(id(module))
            if owners is None:   # once per module, and only on this suspicious path
                ids = {id(p) for p in module.parameters()}
                owners = frozenset(id(o) for o in known if ids & self._ids_of(o))
                self._module_owners[id(module)] = owners
            return next((o for o in ready if id(o) in owners), None)
        if isinstance(parameters, torch.Tensor):
            tensors: Iterable[Any] = (parameters,)
        elif isinstance(parameters, (list, tuple)):
            tensors = parameters[:_PEEK]
        else:
            return ready[0] if all_ready else None
        keys = {id(t) for t in tensors}
        return next((o for o in ready if keys & self._ids_of(o)), None)

    def _ids_of(self, optimizer: Any) -> frozenset[int]:
        groups = optimizer.param_groups
        key = sum(len(g["params"]) for g in groups)
        cached = self._param_ids.get(id(optimizer))
        if cached is None or cached[0] != key:
            cached = (key, frozenset(id(p) for g in groups for p in g["params"]))
            self._param_ids[id(optimizer)] = cached
        return cached[1]
