"""ampdoctor: find, explain and fix mixed-precision training problems in PyTorch.

>>> import torch, ampdoctor
>>> report = ampdoctor.check(torch.nn.Linear(4, 4).half(), scaler=torch.amp.GradScaler("cpu"))
>>> report.codes()
['AMP101']
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "attach": "ampdoctor.runner.attached",
    "audit": "ampdoctor.monitor.parts.numerics_audit",
    "check": "ampdoctor.preflight.engine",
    "explain": "ampdoctor.explanations.crash",
    "fix": "ampdoctor.repairs.upcast",
    "upcast_trainable_params_": "ampdoctor.repairs.upcast",
    "Change": "ampdoctor.repairs.upcast",
    "MasterWeights": "ampdoctor.repairs.master_weights",
    "watch": "ampdoctor.monitor.watcher",
    "Watch": "ampdoctor.monitor.watcher",
    "Finding": "ampdoctor.core.findings",
    "Severity": "ampdoctor.core.findings",
    "Rule": "ampdoctor.core.catalog",
    "RULES": "ampdoctor.core.catalog",
    "get_rule": "ampdoctor.core.catalog",
    "Report": "ampdoctor.core.report",
    "TrainingSetup": "ampdoctor.core.training",
    "advise": "ampdoctor.advice",
    "Advice": "ampdoctor.advice",
}

__all__ = sorted(_LAZY) + ["__version__"]

# What `%load_ext ampdoctor` / `%unload_ext ampdoctor` call on this package: the extension module is imported only then.
_IPYTHON_EXTENSION = {
    "load_ipython_extension": "ampdoctor.integrations.ipython",
    "unload_ipython_extension": "ampdoctor.integrations.ipython",
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import ampdoctor` stays cheap and integrations load only when used.
    module = _LAZY.get(name) or _IPYTHON_EXTENSION.get(name)
    if module is None:
        raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    startup = sys.modules.get("ampdoctor.runner.startup")   # AMPDOCTOR=1: the import above may have imported torch
    if startup is not None:
        startup.run_deferred()
    return value


def __dir__() -> list[str]:
    return __all__
