"""What the training device supports: bf16, fp16 and TF32, read without initialising CUDA when there is none."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["device_support"]

# CPU instruction-set flags (Linux /proc/cpuinfo) that give native bf16 / fp16 arithmetic.
_CPU_BF16 = ("avx512_bf16", "amx_bf16")
_CPU_FP16 = ("avx512_fp16", "amx_fp16")


def device_support(device: str | None = None) -> dict[str, Any]:
    """Return ``{device, name, bf16, fp16, tf32, fp8, prefer, why}`` for the device training will use.

    Args:
        device: ``"cuda"`` (or ``"cuda:1"``) or ``"cpu"``; None: CUDA when torch sees a device, else the CPU.

    ``torch.cuda.is_available()`` does not create a CUDA context; the CUDA queries run only for a CUDA device.

    >>> device_support("cpu")["device"]
    'cpu'
    """
    kind, index = _parse_device(device)
    if kind == "cuda":
        return _cuda_support(index)
    return _cpu_support(asked=device is not None)


def _parse_device(device: str | None) -> tuple[str, int]:
    """Return ``(type, index)`` of the device asked for; raise ValueError for one advise cannot describe."""
    if device is None:
        return ("cuda", 0) if torch.cuda.is_available() else ("cpu", 0)
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA device here "
                             "(torch.cuda.is_available() is False); use 'cpu' or run advise where the GPU is")
        index = parsed.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} was asked for, but torch sees {torch.cuda.device_count()} CUDA "
                             "device(s)")
        return "cuda", index
    return "cpu", 0


def _cuda_support(index: int) -> dict[str, Any]:
    major, minor = torch.cuda.get_device_capability(index)
    with torch.cuda.device(index):
        bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    info = {"device": "cuda", "name": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}",
            "bf16": bf16, "fp16": True, "tf32": major >= 8, "fp8": (major, minor) >= (8, 9)}
    if bf16:
        why = ("bf16 has fp32's exponent range: no loss scaling, no GradScaler, gradients do not underflow; "
               "prefer it over fp16 on this GPU")
    else:
        why = (f"compute capability {major}.{minor} has no native bf16 (Ampere, 8.0, is the first): use fp16 with "
               "a GradScaler")
    info.update(prefer="bf16" if bf16 else "fp16", why=why)
    if major >= 8:
        info["tf32_hint"] = "torch.backends.cuda.matmul.fp32_precision = 'tf32' (fp32 matmuls on tensor cores)"
    return info


def _cpu_support(asked: bool) -> dict[str, Any]:
    flags = _cpu_flags()
    native_bf16 = any(f in flags for f in _CPU_BF16)
    why = "training on the CPU, as asked" if asked else "no CUDA device"
    return {"device": "cpu", "name": platform.processor() or platform.machine(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "bf16": True, "bf16_native": native_bf16, "fp16": True, "fp16_native": any(f in flags for f in _CPU_FP16),
            "tf32": False, "fp8": False, "prefer": "bf16",
            "why": (why + ": CPU autocast runs bf16 (the default for torch.autocast('cpu'))"
                    + (", natively on this CPU (" + ", ".join(f for f in _CPU_BF16 if f in flags) + ")"
                       if native_bf16 else "; this CPU has no avx512_bf16/amx_bf16, so oneDNN emulates it (slower "
                       "than fp32)")
                    + ". TF32 exists only on NVIDIA Ampere and later.")}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()
