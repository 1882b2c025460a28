"""nn.Module internals: what a module registered on itself, and the torch wrappers that only delegate to a module.

``Module._parameters`` and ``Module._modules`` are the dicts ``register_parameter`` and ``add_module`` fill; reading
them directly skips the generator of ``parameters(recurse=False)``/``children()``, which matters in a forward
pre-hook that runs for every module, and keeps ``None`` entries out the same way. Without them (a module class
that builds its own storage) the public iterators answer instead, with the same values.

``torch.compile(module)`` returns an ``OptimizedModule`` that keeps the compiled module in ``_orig_mod``;
``DistributedDataParallel`` and ``DataParallel`` keep it in ``module``. Without the attribute the wrapper is not
seen through, and the names stay the wrapper's.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

# Wrappers of torch that only delegate to the module they hold: class name -> the attribute that holds it.
_DELEGATES = {"DistributedDataParallel": "module", "DataParallel": "module", "OptimizedModule": "_orig_mod"}


def own_parameters(module: nn.Module) -> Iterable[nn.Parameter]:
    """Return the parameters registered on ``module`` itself (not its children), ``None`` entries left out.

    >>> [tuple(p.shape) for p in own_parameters(nn.Linear(3, 2))]
    [(2, 3), (2,)]
    """
    params = getattr(module, "_parameters", None)
    if not isinstance(params, dict):
        return list(module.parameters(recurse=False))
    return [p for p in params.values() if p is not None]


def own_children(module: nn.Module) -> Iterable[nn.Module]:
    """Return the submodules registered on ``module`` itself, ``None`` entries left out.

    >>> [type(m).__name__ for m in own_children(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))]
    ['Linear', 'ReLU']
    """
    children = getattr(module, "_modules", None)
    if not isinstance(children, dict):
        return list(module.children())
    return [m for m in children.values() if m is not None]


def is_delegating_wrapper(module: Any) -> bool:
    """Return whether ``module`` is a torch wrapper that only delegates (DDP, DataParallel, ``torch.compile``'s).

    >>> is_delegating_wrapper(nn.DataParallel(nn.Linear(2, 2))), is_delegating_wrapper(nn.Linear(2, 2))
    (True, False)
    """
    return type(module).__name__ in _DELEGATES


def delegate_of(module: Any) -> nn.Module | None:
    """Return the module a delegating torch wrapper holds, None for any other module.

    >>> type(delegate_of(nn.DataParallel(nn.Linear(2, 2)))).__name__
    'Linear'
    """
    inner = getattr(module, _DELEGATES.get(type(module).__name__, ""), None)
    return inner if isinstance(inner, nn.Module) else None


def has_hooks(module: nn.Module) -> bool:
    """Return whether anyone registered a hook on ``module`` itself (forward, pre-forward, backward): calling it
    again would run them again."""
    return any(getattr(module, name, None) for name in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks"))


def forward_with(module: nn.Module, tensors: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``module.forward`` (not its hooks) with ``tensors`` standing in for its parameters and buffers of those
    names, and put them back after (``torch.nn.utils.stateless``, what ``torch.func.functional_call`` uses)."""
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(module, tensors):
        return module.forward(*args, **kwargs)


def is_compiled(module: Any) -> bool:
    """Return whether ``module`` is what ``torch.compile`` returned (an ``OptimizedModule``: it keeps ``_orig_mod``)."""
    return hasattr(module, "_orig_mod")

