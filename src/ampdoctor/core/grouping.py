"""Findings of one rule with one cause, gathered into one group for the console and the HTML page.

A stray ``.half()`` on a LoRA model makes one AMP101 finding per adapter module, each with the same sentence; a
person needs one row that lists the modules. The JSON report keeps every finding; only what is shown is grouped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from ampdoctor.core.findings import REPAIRED, Finding, Severity

__all__ = ["FindingGroup", "group_findings"]


@dataclass(frozen=True)
class FindingGroup:
    """Findings with one code, severity, process and cause, in the order found.

    Attributes:
        findings: the members, at least one.
    """

    findings: tuple[Finding, ...]

    @property
    def first(self) -> Finding:
        return self.findings[0]

    @property
    def code(self) -> str:
        return self.first.code

    @property
    def severity(self) -> Severity:
        return self.first.severity

    @property
    def process(self) -> str | None:
        return self.first.process

    @property
    def step(self) -> int | None:
        """Return the first step at which a member was seen, or None."""
        steps = [f.step for f in self.findings if f.step is not None]
        return min(steps) if steps else None

    @property
    def places(self) -> list[str]:
        """Return each member's ``where``, once, in order."""
        return list(dict.fromkeys(f.where for f in self.findings))

    @property
    def place_details(self) -> list[str]:
        """Return the places as a list shows them: a module named only by its index in a Sequential (``0``, a bare
        number on a line of its own) by the parameters its finding names (``0.weight (float16, [4, 2])``); a named
        module (``encoder.layer.0.attention.self.query.lora_A.default``) by its name.

        >>> a = Finding("AMP101", Severity.ERROR, "0", "0.weight (float16, [4, 2]) is trainable float16.",
        ...             cause="trainable float16.")
        >>> b = Finding("AMP101", Severity.ERROR, "head", "head.weight (float16, [4, 2]) is trainable float16.",
        ...             cause="trainable float16.")
        >>> group_findings([a, b])[0].place_details
        ['0.weight (float16, [4, 2])', 'head']
        """
        cause = self.first.cause
        shown: dict[str, str] = {}
        for f in self.findings:
            detail = f.detail.removeprefix(REPAIRED)
            own = detail[:-len(cause)] if cause is not None and detail.endswith(cause) else ""
            own = own.rstrip().removesuffix(" are").removesuffix(" is").rstrip()
            shown.setdefault(f.where, own if own and re.fullmatch(r"[\d.]+", f.where) else f.where)
        return list(shown.values())

    @property
    def detail(self) -> str:
        """Return the member's detail, or for many members the sentence they share, with their number.

        >>> a = Finding("AMP101", Severity.ERROR, "fc1", "fc1.bias (float16, [8]) is trainable float16.",
        ...             cause="trainable float16.")
        >>> b = Finding("AMP101", Severity.ERROR, "fc2", "fc2.bias (float16, [8]) is trainable float16.",
        ...             cause="trainable float16.")
        >>> group_findings([a, b])[0].detail
        'Parameters in these 2 modules are trainable float16.'
        >>> from dataclasses import replace   # what --fix repaired says so, grouped too
        >>> group_findings([replace(f, detail=REPAIRED + f.detail) for f in (a, b)])[0].detail[:45]
        'repaired in this run by --fix; the script its'
        """
        if len(self.findings) == 1:
            return self.first.detail
        if self.first.cause is not None:   # a group --fix repaired says so first, as each of its findings does
            lead = REPAIRED if self.first.detail.startswith(REPAIRED) else ""
            return f"{lead}Parameters in these {len(self.places)} modules are {self.first.cause}"
        return self.first.detail  # grouped only when every detail is this one


def group_findings(findings: Iterable[Finding]) -> list[FindingGroup]:
    """Return the findings gathered by code, severity, process and cause, in the order of each group's first member.

    Findings without a ``cause`` are gathered only when their detail is the same sentence.

    >>> f = [Finding("AMP101", Severity.ERROR, m, f"{m}.w is half.", cause="half.") for m in ("a", "b")]
    >>> [(g.code, g.places) for g in group_findings(f + [Finding("AMP104", Severity.ERROR, "opt", "eps")])]
    [('AMP101', ['a', 'b']), ('AMP104', ['opt'])]
    """
    groups: dict[tuple[object, ...], list[Finding]] = {}
    for f in findings:
        key = (f.code, f.severity, f.process, f.ranks,
               ("cause", f.cause) if f.cause is not None else ("detail", f.detail))
        groups.setdefault(key, []).append(f)
    return [FindingGroup(tuple(members)) for members in groups.values()]
