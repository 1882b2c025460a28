"""A short description of the machine, small enough to paste into an issue."""

from __future__ import annotations

import platform
import sys

import torch


def environment() -> dict[str, object]:
    """Return torch version, device and low-precision support of this process.

    >>> "torch" in environment()
    True
    """
    cuda = torch.cuda.is_available()
    env: dict[str, object] = {
        "ampdoctor": _version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(terse=True),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "bf16_supported": bool(torch.cuda.is_bf16_supported()) if cuda else True,
        "fp16_autocast_cpu": True,
    }
    return env


def _version() -> str:
    from ampdoctor import __version__

    return __version__
