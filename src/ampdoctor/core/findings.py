"""Immutable records of what ampdoctor found."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

# how a finding --fix repaired in this run begins (``session.repair.split_repaired``); a group of them keeps it
REPAIRED = "repaired in this run by --fix; the script itself still has it: "


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
        ranks: the ranks of a distributed run (torchrun) that saw this very finding, e.g. ``(0, 1)``, or ``None``
            outside a distributed run. Ranks that saw one finding at the same place and step share it
            (``ampdoctor.ranks.merge.merge_rank_reports``); another place or step stays apart.
        fix: the fix that fits what this finding saw (the setup, the cause its detail names), as code, or ``None``
            for the rule's own fix. The report and the views show it in the rule's place.

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
    ranks: tuple[int, ...] | None = None
    fix: str | None = None

    @property
    def place(self) -> tuple[str, str, str | None]:
        """One rule at one place in one process: what is reported once, and what a fix resolves (``code``,
        ``where``, ``process``)."""
        return self.code, self.where, self.process

    @property
    def key(self) -> tuple[str, str, str | None, int | None]:
        """The identity of a finding: one rule at one place in one process, at one step (``place`` and ``step``).
        A report holds each once per set of ranks; ranks that saw it share one (``ranks.merge``).

        >>> a = Finding("AMP605", Severity.WARNING, "fc", "3%", step=2)
        >>> b = Finding("AMP605", Severity.WARNING, "fc", "4%", 2)
        >>> a.key == b.key, a.place == Finding("AMP605", Severity.WARNING, "fc", "1%", step=9).place
        (True, True)
        """
        return *self.place, self.step

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict; the catalog's title and fix are added by the report."""
        data = asdict(self)
        data["severity"] = self.severity.value
        for optional in ("process", "cause", "ranks", "fix"):
            if data[optional] is None:
                del data[optional]
        if self.ranks is not None:
            data["ranks"] = list(self.ranks)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "Finding":
        """Rebuild a finding from `to_dict` output (a JSON report, a flight recorder's line); raise ``ValueError``
        on anything else. Optional fields of the wrong type read as absent.

        >>> f = Finding.from_dict({"code": "AMP101", "severity": "error", "where": "fc", "detail": "half", "step": "?"})
        >>> f.severity, f.step
        (<Severity.ERROR: 'error'>, None)
        """
        try:
            step, process, cause, fix = data.get("step"), data.get("process"), data.get("cause"), data.get("fix")
            return cls(str(data["code"]), Severity(data["severity"]), str(data["where"]), str(data["detail"]),
                       step if isinstance(step, int) else None, process if isinstance(process, str) else None,
                       cause if isinstance(cause, str) else None, read_ranks(data.get("ranks")),
                       fix if isinstance(fix, str) and fix else None)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed finding {data!r:.200}: {exc!r:.200}") from None


def read_ranks(value: object) -> tuple[int, ...] | None:
    """Return the ``ranks`` of a finding read back from JSON: sorted distinct ints, or ``None`` for anything else.

    >>> read_ranks([1, 0, 1]), read_ranks(None), read_ranks(["0"])
    ((0, 1), None, None)
    """
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value):
        return None
    return tuple(sorted(set(value)))
