"""Immutable records of what ampdoctor found."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class Severity(str, enum.Enum):
    """How much a finding hurts. Ordered: ``ERROR`` stops training, ``INFO`` only informs."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return {"error": 0, "warning": 1, "info": 2}[self.value]


@dataclass(frozen=True)
class Finding:
    """One problem found on a real object.

    Attributes:
        code: the catalog code of the rule, for example ``"AMP101"``.
        severity: copied from the rule unless the rule escalates it.
        where: the object at fault, for example ``"model.encoder.layer.0 (lora_A.default.weight)"``.
        detail: what was observed, with the actual values.
        step: the optimizer step at which it was seen, or ``None`` before the first step.
        process: the child process it was seen in (``"pid 123: python train.py"``), or ``None`` for the process
            that ran ``ampdoctor``.
        cause: the part of ``detail`` that findings of one rule at many places share (``"trainable float16 while
            GradScaler('cuda') is enabled …"``), or ``None``. Findings with one code and one cause are shown as one
            row listing the places (``core.grouping``); the JSON keeps each.

    >>> Finding("AMP101", Severity.ERROR, "fc.weight", "float16, requires_grad").code
    'AMP101'
    """

    code: str
    severity: Severity
    where: str
    detail: str
    step: int | None = None
    process: str | None = None
    cause: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict; the catalog's title and fix are added by the report."""
        data = asdict(self)
        data["severity"] = self.severity.value
        for optional in ("process", "cause"):
            if data[optional] is None:
                del data[optional]
        return data
