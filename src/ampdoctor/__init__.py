"""ampdoctor: find, explain and fix mixed-precision training problems in PyTorch.

>>> import torch, ampdoctor
>>> report = ampdoctor.check(torch.nn.Linear(4, 4).half(), scaler=torch.amp.GradScaler("cpu"))
>>> report.codes()
['AMP101']
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "check": "ampdoctor.preflight",
    "explain": "ampdoctor.explain",
    "fix": "ampdoctor.fixes",
    "upcast_trainable_params_": "ampdoctor.fixes",
    "Change": "ampdoctor.fixes",
    "MasterWeights": "ampdoctor.master_weights",
    "watch": "ampdoctor.watcher",
    "Watch": "ampdoctor.watcher",
    "Finding": "ampdoctor.findings",
    "Severity": "ampdoctor.findings",
    "Rule": "ampdoctor.catalog",
    "RULES": "ampdoctor.catalog",
    "get_rule": "ampdoctor.catalog",
    "Report": "ampdoctor.report",
    "TrainingSetup": "ampdoctor.training",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import ampdoctor` stays cheap and integrations load only when used.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
