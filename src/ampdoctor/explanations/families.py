"""The rule families of the catalog, by code prefix, and the one an unexplained error text comes closest to.

A text no rule's ``errors`` pattern matches is unknown. When it still reads like one family (it names a half dtype
and a mismatch, the GradScaler's state, an inf/NaN), the answer names that family, so the user knows which rules to
read; anything else gets no family. The hints are deliberately narrow: a wrong family is worse than none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ampdoctor.core.catalog import MAX_TEXT, Rule, select

_DTYPE = r"\b(Half|BFloat16|float16|bfloat16|fp16|bf16|c10::Half|at::Half)\b"


@dataclass(frozen=True)
class Family:
    """A group of catalog rules sharing a code prefix.

    Attributes:
        prefix: the code prefix, e.g. ``"AMP5"``.
        title: what the family is about, e.g. ``"dtype mismatch"``.
        hints: regular expressions (each a bounded, linear pattern) that a text of this family contains.
    """

    prefix: str
    title: str
    hints: tuple[str, ...]
    _compiled: tuple[re.Pattern[str], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple(re.compile(h, re.IGNORECASE) for h in self.hints))

    @property
    def codes(self) -> list[str]:
        """Return the codes of the rules in this family, in catalog order."""
        return [r.code for r in select([self.prefix])]

    def closest(self, text: str, n: int = 3) -> list[Rule]:
        """Return up to ``n`` rules of this family whose titles share the most words with ``text``, two at least
        (one shared word names no rule): of those, a short title that says it all first, then catalog order.

        >>> [r.code for r in FAMILIES[3].closest("loss is nan")]
        ['AMP613', 'AMP610']
        """
        said = _words(text[-MAX_TEXT:])
        scored = []
        for i, rule in enumerate(select([self.prefix])):
            title = _words(rule.title)
            scored.append((len(said & title), len(said & title) / len(title), i, rule))
        most = max((t[0] for t in scored), default=0)
        return [t[3] for t in sorted(scored, key=lambda t: (-t[1], t[2])) if t[0] == most >= 2][:n]

    @property
    def label(self) -> str:
        """Return ``dtype mismatch (AMP5xx)``."""
        return f"{self.title} ({self.prefix}xx)"

    def hinted_by(self, line: str) -> bool:
        return any(p.search(line) for p in self._compiled)


# Most specific first: a line naming the GradScaler and a dtype is about the scaler.
FAMILIES: tuple[Family, ...] = (
    Family("AMP4", "GradScaler state machine", (
        r"\bGradScaler\b[^\n]{0,200}\b(step|update|unscale_?|scale)\b",
        r"\bscaler\.(step|update|unscale_|scale)\(",
        r"\binf checks?\b",
    )),
    Family("AMP1", "trainable parameter dtypes", (
        r"\bunscale\w*\b[^\n]{0,200}" + _DTYPE,
        _DTYPE + r"[^\n]{0,200}\bgradients?\b",
    )),
    Family("AMP5", "dtype mismatch", (
        _DTYPE + r"[^\n]{0,200}\b(expected|same|match|matching|mismatch|convert|converted|promot\w*|"
                 r"not implemented|not supported)\b",
        r"\b(expected|same|match|matching|mismatch|convert|converted|promot\w*|not implemented|not supported)\b"
        r"[^\n]{0,200}" + _DTYPE,
    )),
    Family("AMP6", "inf/NaN numerics", (
        r"\b(nan|inf|non-finite|nonfinite)\b[^\n]{0,200}\b(loss|grad\w*|activation\w*|output|values?)\b",
        r"\b(loss|grad\w*|activation\w*|output|values?)\b[^\n]{0,200}\b(nan|inf|non-finite|nonfinite)\b",
    )),
    Family("AMP2", "scaler, autocast and accelerator configuration", (
        r"\bautocast\b",
        r"\bmixed[_ ]precision\b",
    )),
)


# words that tell no rule of a family from another: grammar, and the half dtypes every dtype rule names
_STOP = frozenset("a an the is are was were in of to or and by on for its it at with not no but got "
                  "dtype dtypes half float16 bfloat16 fp16 bf16 precision".split())


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9_]+", text.lower()) if w not in _STOP} or {""}


def closest_family(text: str) -> Family | None:
    """Return the family an error text reads like, or None: the last line (the error itself) that hints one wins.

    Use it only when no rule matched; work is bounded like `ampdoctor.core.catalog.rules_for_error`.

    >>> closest_family("RuntimeError: expected tensor of dtype BFloat16 but got Half").label
    'dtype mismatch (AMP5xx)'
    >>> closest_family("KeyError: 'foo'") is None
    True
    """
    for line in reversed(text[-MAX_TEXT:].splitlines()[-200:]):   # the error is at the end of a traceback
        line = line[:2_000]
        for family in FAMILIES:
            if family.hinted_by(line):
                return family
    return None
