"""What a watch says of itself as data: the flight recorder's header and the formats the run trains in.

Everything here works on plain data (the JSON-ready dicts ``Watch.summary_data()`` returns and the host values of
the statistics); nothing touches the model, the optimizer or the scaler beyond reading a few settings. The summary
is drawn by ``ampdoctor.ui.watch_view``.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from ampdoctor.core.isolation import call_safely
from ampdoctor.monitor.grad_stats import COLUMNS, FORMATS

__all__ = ["log_header", "run_formats"]


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


def run_formats(scaler: Any, param_dtypes: Sequence[str], autocast: str | None = None) -> list[str]:
    """Return the simulated formats that describe this run, for the summary's columns.

    An fp16 GradScaler means fp16; bf16 parameters, or fp32 ones under bf16 autocast (``autocast``: the dtype name
    the model's forward ran under), mean bf16; fp16 parameters or fp16 autocast fp16; fp32 parameters with neither
    known could be either. fp8 columns (per-tensor amax scaling, TransformerEngine's and torchao's tensorwise recipe)
    only when parameters are fp8; the JSON and the flight recorder have them always.

    >>> run_formats(None, ["float32"]), run_formats(None, ["bfloat16"]), run_formats(None, ["float8_e4m3fn"])
    (['fp16', 'bf16'], ['bf16'], ['fp16', 'bf16', 'e4m3', 'e5m2'])
    >>> run_formats(None, ["float32"], autocast="bfloat16")
    ['bf16']
    """
    if scaler is not None:
        chosen = ["fp16"]
    elif autocast in ("bfloat16", "float16"):
        chosen = ["bf16" if autocast == "bfloat16" else "fp16"]
    elif "bfloat16" in param_dtypes:
        chosen = ["bf16"]
    elif "float16" in param_dtypes:
        chosen = ["fp16"]
    else:
        chosen = ["fp16", "bf16"]
    if any(d.startswith("float8") for d in param_dtypes):
        chosen = ["fp16", "bf16", "e4m3", "e5m2"]
    return chosen
