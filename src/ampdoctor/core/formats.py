"""The low-precision formats a run is measured in: each described by where round-to-nearest-even loses a value, and
which of them describe a run (`run_formats`, chosen once per run and read by every view)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["FloatFormat", "FP16", "BF16", "E4M3", "E5M2", "FORMATS", "LOSS_SCALED", "lost_below", "run_formats"]


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
        mantissa: the significand bits stored (fp16 10, bf16 7): ``w + u == w`` when ``|u|`` is below half an ulp
            of ``w``, which is between ``|w|·2**-(mantissa+2)`` and ``|w|·2**-(mantissa+1)`` (`lost_below`).

    >>> FP16.underflow_at_most == 2**-25
    True
    """

    name: str
    max: float
    min_subnormal: float
    overflow_above: float
    min_normal: float
    mantissa: int = 0

    @property
    def underflow_at_most(self) -> float:
        """``0 < |x| <= this`` rounds to zero: half the smallest subnormal; the tie goes to the even neighbour, 0."""
        return self.min_subnormal / 2


def _float32_below(x: float) -> float:
    """Return the largest float32 strictly below ``x``."""
    return float(torch.nextafter(torch.tensor(x, dtype=torch.float32), torch.tensor(0.0)).item())


# fp16: max 65504 = (2 - 2**-10) * 2**15 has an odd mantissa, so the tie at 65520 rounds up to inf.
FP16 = FloatFormat("fp16", 65504.0, 2.0**-24, _float32_below(65520.0), 2.0**-14, mantissa=10)
# bf16: max (2 - 2**-7) * 2**127, odd mantissa; the tie at 2**128 - 2**119 rounds up to inf.
BF16 = FloatFormat("bf16", (2 - 2.0**-7) * 2.0**127, 2.0**-133, _float32_below(2.0**128 - 2.0**119), 2.0**-126,
                   mantissa=7)
# e4m3fn: max 448 = 1.75 * 2**8 has an even mantissa, so the tie at 464 rounds down to 448; above it is NaN.
E4M3 = FloatFormat("e4m3", 448.0, 2.0**-9, 464.0, 2.0**-6, mantissa=3)
# e5m2: max 57344 = 1.75 * 2**15, odd mantissa; the tie at 61440 rounds up to inf.
E5M2 = FloatFormat("e5m2", 57344.0, 2.0**-16, _float32_below(61440.0), 2.0**-14, mantissa=2)

FORMATS: tuple[FloatFormat, ...] = (FP16, BF16, E4M3, E5M2)
LOSS_SCALED: tuple[FloatFormat, ...] = (FP16, BF16)  # simulated at the loss scale; the others at their own amax


def lost_below(fmt: FloatFormat) -> str:
    """Return the relative size of an update that always rounds away in a weight of format ``fmt``: half an ulp of
    ``w`` is at least ``|w|·2**-(mantissa+2)`` (at most twice that, as ``w`` runs up to the next power of two).
    Every sentence that says so (AMP103, AMP607, the master weights' docs) says this.

    >>> lost_below(BF16), lost_below(FP16)
    ('|w|·2**-9', '|w|·2**-12')
    """
    return f"|w|·2**-{fmt.mantissa + 2}"


def run_formats(scaler: bool, param_dtypes: Sequence[str], autocast: str | None = None) -> list[str]:
    """Return the formats that describe a run, in ``FORMATS``' order: the one it computes in, plus fp16 where an fp16
    GradScaler is enabled (its loss scale is about fp16's range, whatever the run computes in).

    The run computes in its autocast dtype (``autocast``: the dtype name the model's forward ran under), else in its
    parameters' half dtype; fp32 parameters with neither known could be either, so both are shown. fp8 parameters
    (per-tensor amax scaling: TransformerEngine's and torchao's tensorwise recipe) add the fp8 formats. The watch
    makes this choice once per run (``Watch.formats``); the summary, the console, the JSON, ``ampdoctor report`` and
    the HTML page all read it from there.

    >>> run_formats(False, ["float32"]), run_formats(False, ["bfloat16"]), run_formats(True, ["float32"], "bfloat16")
    (['fp16', 'bf16'], ['bf16'], ['fp16', 'bf16'])
    >>> run_formats(True, ["float32"], "float16"), run_formats(False, ["float8_e4m3fn"])
    (['fp16'], ['fp16', 'bf16', 'e4m3', 'e5m2'])
    """
    if autocast in ("bfloat16", "float16"):
        chosen = {"bf16" if autocast == "bfloat16" else "fp16"}
    elif "bfloat16" in param_dtypes:
        chosen = {"bf16"}
    elif "float16" in param_dtypes:
        chosen = {"fp16"}
    else:
        chosen = {"fp16", "bf16"}
    if scaler:
        chosen.add("fp16")
    if any(d.startswith("float8") for d in param_dtypes):
        chosen |= {"fp16", "bf16", "e4m3", "e5m2"}
    return [f.name for f in FORMATS if f.name in chosen]
