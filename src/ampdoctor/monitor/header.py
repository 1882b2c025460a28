"""The flight recorder's header line of a watch: versions, environment, settings, formats and the parameters.

Nothing here touches the model, the optimizer or the scaler beyond reading a few settings.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from ampdoctor.core.formats import FORMATS
from ampdoctor.core.isolation import call_safely
from ampdoctor.monitor.grad_stats import COLUMNS

__all__ = ["log_header"]


def log_header(optimizer: Any, scaler: Any, *, every: int, stats: str, sample: int,
               params: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return the flight recorder's header line: versions, environment, settings, formats and the parameters.

    Args:
        optimizer: the torch optimizer that applies the updates (its class and ``fused``/``foreach`` defaults).
        scaler: the enabled GradScaler, or None.
        every, stats, sample: the watch's settings.
        params: one ``{"name", "module", "dtype", "shape"}`` dict per parameter, in the optimizer's order.
    """
    from ampdoctor import __version__
    from ampdoctor.core.environment import environment

    defaults = getattr(optimizer, "defaults", {})
    return {
        # no device facts yet: the script may not have chosen its CUDA device (they go in the end line)
        "ampdoctor": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": environment(devices=False),
        "every": every, "stats": stats, "sample": sample,
        "optimizer": {"class": type(optimizer).__name__, "fused": defaults.get("fused"),
                      "foreach": defaults.get("foreach")},
        "scaler": None if scaler is None else {"class": type(scaler).__name__,
                                               "growth_interval": _setting(scaler, "get_growth_interval"),
                                               "backoff_factor": _setting(scaler, "get_backoff_factor")},
        "formats": {f.name: {"max": f.max, "min_subnormal": f.min_subnormal, "underflow_at_most":
                             f.underflow_at_most, "overflow_above": f.overflow_above} for f in FORMATS},
        "grad_columns": list(COLUMNS),
        "params": list(params),
    }


def _setting(scaler: Any, getter: str) -> Any:
    """Return a GradScaler setting through its public getter; None when the scaler has none (or it raises)."""
    method = getattr(scaler, getter, None)
    return call_safely(method) if callable(method) else None
