"""The low-precision float formats, defined once, and how findings name a dtype."""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)  # the 16-bit float formats
FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
            if hasattr(torch, n))
LOW_PRECISION = frozenset(HALF + FP8)


def dtype_name(value: torch.dtype | torch.Tensor) -> str:
    """Return the name of a dtype (or of a tensor's dtype) without the ``torch.`` prefix.

    >>> dtype_name(torch.float16), dtype_name(torch.zeros(1))
    ('float16', 'float32')
    """
    dtype = value if isinstance(value, torch.dtype) else value.dtype
    return str(dtype).removeprefix("torch.")
