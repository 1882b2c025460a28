"""Count nouns in ampdoctor's sentences: "1 step", "3 steps", "2 passes", never "step(s)"."""

from __future__ import annotations

__all__ = ["counted", "word_for"]


def word_for(n: int, word: str, many: str | None = None) -> str:
    """Return ``word`` for one and its plural otherwise: ``many``, or ``word`` with an ``s``.

    >>> word_for(1, "rank"), word_for(2, "rank"), word_for(0, "pass", "passes")
    ('rank', 'ranks', 'passes')
    """
    return word if n == 1 else many or f"{word}s"


def counted(n: int, word: str, many: str | None = None) -> str:
    """Return ``n`` and the word that fits it.

    >>> counted(1, "sampled step"), counted(3, "change"), counted(2, "backward pass", "backward passes")
    ('1 sampled step', '3 changes', '2 backward passes')
    """
    return f"{n} {word_for(n, word, many)}"
