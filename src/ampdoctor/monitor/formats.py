"""The low-precision formats a gradient is simulated in, described by where round-to-nearest-even loses a value."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FloatFormat", "FP16", "BF16", "E4M3", "E5M2", "FORMATS", "LOSS_SCALED"]


@dataclass(frozen=True)
class FloatFormat:
    """A low-precision format, described by the magnitudes where round-to-nearest-even loses a value.

    Attributes:
        name: short name used in column names (``"fp16"``).
        max: the largest finite value.
        min_subnormal: the smallest positive value.
        overflow_above: ``|x| > overflow_above`` rounds past ``max`` (to inf or NaN; torch's e4m3fn cast saturates
            it to 448 instead, which loses the value just the same). It is the largest float32 that still rounds to
            a finite value.
        min_normal: the smallest normal value; below it a value keeps fewer significant bits (a subnormal).

    >>> FP16.underflow_at_most == 2**-25
    True
    """

    name: str
    max: float
    min_subnormal: float
    overflow_above: float
    min_normal: float

    @property
    def underflow_at_most(self) -> float:
        """``0 < |x| <= this`` rounds to zero: half the smallest subnormal; the tie goes to the even neighbour, 0."""
        return self.min_subnormal / 2


def _float32_below(x: float) -> float:
    """Return the largest float32 strictly below ``x``."""
    return float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(0.0)).item())


# fp16: max 65504 = (2 - 2**-10) * 2**15 has an odd mantissa, so the tie at 65520 rounds up to inf.
FP16 = FloatFormat("fp16", 65504.0, 2.0**-24, _float32_below(65520.0), 2.0**-14)
# bf16: max (2 - 2**-7) * 2**127, odd mantissa; the tie at 2**128 - 2**119 rounds up to inf.
BF16 = FloatFormat("bf16", (2 - 2.0**-7) * 2.0**127, 2.0**-133, _float32_below(2.0**128 - 2.0**119), 2.0**-126)
# e4m3fn: max 448 = 1.75 * 2**8 has an even mantissa, so the tie at 464 rounds down to 448; above it is NaN.
E4M3 = FloatFormat("e4m3", 448.0, 2.0**-9, 464.0, 2.0**-6)
# e5m2: max 57344 = 1.75 * 2**15, odd mantissa; the tie at 61440 rounds up to inf.
E5M2 = FloatFormat("e5m2", 57344.0, 2.0**-16, _float32_below(61440.0), 2.0**-14)

FORMATS: tuple[FloatFormat, ...] = (FP16, BF16, E4M3, E5M2)
LOSS_SCALED: tuple[FloatFormat, ...] = (FP16, BF16)  # simulated at the loss scale; the others at their own amax
