"""A short description of the machine, small enough to paste into an issue.

Device facts are read when they are first looked at, not when a Doctor, a ``check()`` or a watch is built: under
``torchrun`` a script calls ``torch.cuda.set_device(local_rank)`` after ampdoctor attaches, and asking for the
device name earlier would open a CUDA context on GPU 0 from every rank.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Iterator, Mapping

import torch


class Environment(Mapping):
    """The facts of ``environment()``, read on first access and then kept.

    >>> env = Environment()
    >>> env.read
    False
    >>> "torch" in env, env.read
    (True, True)
    """

    def __init__(self) -> None:
        self._facts: dict[str, object] | None = None

    @property
    def read(self) -> bool:
        """Whether the facts have been read yet."""
        return self._facts is not None

    def _get(self) -> dict[str, object]:
        if self._facts is None:
            self._facts = environment()
        return self._facts

    def __getitem__(self, key: str) -> object:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return f"Environment({self._facts!r})" if self.read else "Environment(<not read yet>)"


def environment(devices: bool = True) -> dict[str, object]:
    """Return torch version, device and low-precision support of this process.

    Args:
        devices: also describe the CUDA device in use. It is read only where the process already initialised
            CUDA (on the device it chose); a process that never touched CUDA keeps it that way.

    >>> "torch" in environment()
    True
    """
    cuda = torch.cuda.is_available()   # asks the driver for a count; creates no context
    env: dict[str, object] = {
        "ampdoctor": _version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(terse=True),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "fp16_autocast_cpu": True,
    }
    if not devices:
        return env
    if not cuda:
        env.update(device="cpu", bf16_supported=True)
    elif torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        env.update(device=torch.cuda.get_device_name(index), cuda_device_index=index,
                   bf16_supported=bool(torch.cuda.is_bf16_supported()))
    else:
        env.update(device="cpu (CUDA is available but this process did not use it)", bf16_supported=None)
    return env


def _version() -> str:
    from ampdoctor import __version__

    return __version__
