"""Which layers get LoRA adapters, how many parameters the adapters add, and adapters for the fake run.

The choice follows peft: for a transformers model whose ``model_type`` is in peft's
``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` (``q_proj`` and ``v_proj`` for Llama, Mistral, Qwen2;
``c_attn`` for GPT-2; ``query`` and ``value`` for BERT) those modules are the targets, as ``LoraConfig()`` without
``target_modules`` picks them. For any other model every ``nn.Linear`` (and transformers ``Conv1D``) except the
output head is a target: peft's ``target_modules="all-linear"``. A target with ``in`` inputs and ``out`` outputs
gets ``A`` (``r x in``) and ``B`` (``out x r``): ``r * (in + out)`` parameters, no bias.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["lora_targets", "lora_parameter_count", "add_adapters_"]

# peft 0.21's defaults for common model types, used when peft is not installed.
_DEFAULT_TARGETS: dict[str, list[str]] = {
    "llama": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"],
    "gemma": ["q_proj", "v_proj"], "opt": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "bert": ["query", "value"],
    "t5": ["q", "v"], "phi": ["q_proj", "v_proj", "fc1", "fc2"],
}


def _peft_defaults(model_type: str | None) -> list[str] | None:
    if model_type is None:
        return None
    try:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping
    except ImportError:
        mapping = _DEFAULT_TARGETS
    found = mapping.get(model_type)
    return list(found) if found else None


def _in_out(module: nn.Module) -> tuple[int, int] | None:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers' GPT-2 layer: weight (in, out)
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def lora_targets(model: nn.Module, model_type: str | None) -> tuple[list[tuple[str, int, int]], str]:
    """Return ``[(module name, in, out)]`` of the layers that get adapters, and the rule that chose them.

    >>> lora_targets(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), None)[0]
    [('0', 4, 8), ('2', 8, 2)]
    """
    names = _peft_defaults(model_type)
    head = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        head = getter()
    found = []
    for name, module in model.named_modules():
        shape = _in_out(module)
        if shape is None:
            continue
        if names is not None:
            if any(name == key or name.endswith("." + key) for key in names):
                found.append((name, *shape))
        elif module is not head:
            found.append((name, *shape))
    rule = (f"peft's default target modules for model_type {model_type!r}: {', '.join(names)}" if names else
            "every Linear layer except the output head (peft's target_modules='all-linear')")
    return found, rule


def lora_parameter_count(targets: list[tuple[str, int, int]], rank: int) -> int:
    """Return the adapter parameters: ``rank * (in + out)`` per target.

    >>> lora_parameter_count([("q", 4096, 4096), ("v", 4096, 4096)], 8)
    131072
    """
    return sum(rank * (i + o) for _, i, o in targets)


class _Adapted(nn.Module):
    """``base(x) + B(A(x)) * alpha / r``: what peft's ``lora.Linear`` computes with dropout 0."""

    def __init__(self, base: nn.Module, rank: int, in_features: int, out_features: int, dtype: Any) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(in_features, rank, bias=False, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, dtype=dtype)
        self.scaling = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_adapters_(model: nn.Module, targets: list[tuple[str, int, int]], rank: int,
                  dtype: Any = torch.float32) -> list[nn.Parameter]:
    """Freeze ``model`` and wrap each target with trainable ``dtype`` adapters (on the model's device); return
    the adapter parameters. For the meta/fake copy that the activation run uses, not for the user's model."""
    for p in model.parameters():
        p.requires_grad_(False)
    added: list[nn.Parameter] = []
    for name, i, o in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        device = next(base.parameters()).device
        with torch.device(device):
            wrapped = _Adapted(base, rank, i, o, dtype)
        setattr(parent, child, wrapped)
        added += [wrapped.lora_A.weight, wrapped.lora_B.weight]
    return added
