"""The findings only a framework callback can make: AMP209, AMP610 (records in ``ampdoctor.core.catalog``).

A callback reads what the framework was asked for (``TrainingArguments(fp16=True)``, ``logging_nan_inf_filter``,
``max_grad_norm``) next to what the loop did, which no torch hook sees.
"""

from __future__ import annotations

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding

HALF_MODEL, LOSS_HIDDEN = "AMP209", "AMP610"


def integration_finding(code: str, where: str, detail: str, step: int | None = None) -> Finding:
    """Return a finding of ``code`` with the catalog's severity.

    >>> integration_finding("AMP611", "TrainingArguments(max_grad_norm=1.0)", "clipped 3 of 4 steps").severity.value
    'info'
    """
    return Finding(code, get_rule(code).severity, where, detail, step)
