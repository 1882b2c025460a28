"""Memory and precision advice: which training strategy fits the device, and which is numerically safe.

``ampdoctor.advise(model, batch_size=..., seq_len=..., budget="24GiB")`` and ``ampdoctor advise PATH``: see
docs/advise.md. Model-state bytes are counted per tensor (equal to the real tensors'); activations are measured by
one fake forward and backward per strategy (``activations.py``). Names load lazily. The command and the drawing are
``ampdoctor.ui.advise_command`` and ``ampdoctor.ui.advice_view``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"advise": "advisor", "Advice": "advisor", "parse_size": "advisor"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
