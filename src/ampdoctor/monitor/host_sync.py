"""The one host sync of a sampled step: every monitor's pending device tensors, copied with one ``.tolist()``."""

from __future__ import annotations

import torch

__all__ = ["host_copy"]


def host_copy(parts: dict[str, dict[str, torch.Tensor]]) -> tuple[dict[str, dict[str, list[float]]], bool]:
    """Return the host values of ``{part: {key: tensor}}`` as flat lists, and whether a sync happened.

    The tensors are flattened and concatenated on the first one's device (float64; float32 on MPS, which has no
    float64), then copied in one sync; parts without tensors come back as ``{}``.

    >>> host_copy({"a": {"x": torch.ones(2)}, "b": {}})
    ({'a': {'x': [1.0, 1.0]}, 'b': {}}, True)
    """
    flat = [(m, k, t) for m, d in parts.items() for k, t in d.items()]
    out: dict[str, dict[str, list[float]]] = {m: {} for m in parts}
    if not flat:
        return out, False
    device = flat[0][2].device
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    joined = torch.cat([t.detach().reshape(-1).to(device=device, dtype=dtype) for _, _, t in flat])
    values = joined.tolist()  # the one host sync
    offset = 0
    for m, k, t in flat:
        out[m][k] = values[offset:offset + t.numel()]
        offset += t.numel()
    return out, True
