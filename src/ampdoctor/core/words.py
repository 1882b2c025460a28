"""Count nouns in ampdoctor's sentences: "1 step", "3 steps", "2 passes", never "step(s)"; and write a loss scale
the same way in every view."""

from __future__ import annotations

__all__ = ["counted", "scale_text", "word_for"]


def scale_text(value: float) -> str:
    """Return a loss scale as every view writes it (findings, the watch's line, ``ampdoctor report``, the page): whole
    where six digits hold it exactly (a power of two such as 65536 or 0.125), else three significant digits.

    >>> scale_text(65536.0), scale_text(0.125), scale_text(5.684341886080802e-14), scale_text(float("nan"))
    ('65536', '0.125', '5.68e-14', 'nan')
    """
    text = f"{value:.6g}"
    return text if text in ("nan", "inf") or float(text) == value else f"{value:.3g}"


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
