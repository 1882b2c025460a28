"""The strategies, and the bytes of weights, gradients, optimizer state and master copies each one keeps.

Everything is counted per parameter tensor, the way torch allocates it, so that the numbers equal
``sum(t.numel() * t.element_size())`` over the real tensors (the tests build each strategy for real and compare):

* torch ``AdamW``: ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype, and a ``step`` tensor of one fp32
  value per parameter tensor (``capturable=False``, not fused). ``SGD(momentum=0.9)``: one ``momentum_buffer``.
* bitsandbytes ``AdamW8bit`` (block-wise, the default): per tensor of at least 4096 elements two ``uint8`` states
  and one fp32 ``absmax`` per block of 256 for each, 2 + 8/256 ≈ 2.03 B/param; smaller tensors keep fp32 states
  (``min_8bit_size = 4096``). From ``bitsandbytes/optim/optimizer.py`` (``Optimizer2State.init_state``); not
  measured here (bitsandbytes is not a dependency).
* ZeRO stages (DeepSpeed, the ZeRO paper's accounting, arXiv:1910.02054 §3.1): half parameters (2 B), half
  gradients (2 B), fp32 master copy (4 B) and fp32 Adam state (8 B); stage 1 divides optimizer state and masters
  by N, stage 2 also gradients, stage 3 also the half weights. DeepSpeed's own estimator adds fp32 gradient
  buffers and a 1.5x buffer factor (``estimate_zero2_model_states_mem_needs``), not counted here.
* FSDP2 (``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bfloat16)``): fp32 sharded parameters, gradients
  and Adam state all divided by N; one block's parameters are gathered in bf16 at a time (added to weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Strategy", "STRATEGIES", "ParamInfo", "optimizer_bytes", "model_state_bytes", "OPTIMIZERS",
           "sharded_keys"]

OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
BNB_BLOCK = 256          # bitsandbytes block-wise quantization: one fp32 absmax per 256 entries
BNB_MIN_8BIT = 4096      # tensors with fewer elements keep fp32 states


@dataclass(frozen=True)
class Strategy:
    """One way to train: dtypes of the model states, and which fake run measures its activations.

    Attributes:
        key: stable id used in the JSON (``"amp_bf16"``).
        title: one line for tables.
        run: the activation run: ``fp32``, ``autocast`` (fp32 params, half autocast), ``checkpoint`` (autocast and
            ``torch.utils.checkpoint`` per block), ``half`` (half params, no autocast) or ``lora``.
        compute: the low-precision format the math runs in (``fp16``, ``bf16``) or ``fp32``.
        note: a caveat shown with the row.
    """

    key: str
    title: str
    run: str
    compute: str
    note: str = ""


STRATEGIES: tuple[Strategy, ...] = (
    Strategy("fp32", "fp32 parameters, no autocast", "fp32", "fp32"),
    Strategy("amp_fp16", "AMP fp16: fp32 params, autocast fp16 + GradScaler", "autocast", "fp16"),
    Strategy("amp_bf16", "AMP bf16: fp32 params, autocast bf16", "autocast", "bf16"),
    Strategy("amp_bf16_checkpoint", "AMP bf16 + gradient checkpointing per block", "checkpoint", "bf16",
             "recomputes each block's forward in backward: about 1/3 more compute"),
    Strategy("amp_bf16_adamw8bit", "AMP bf16 + bitsandbytes AdamW8bit", "autocast", "bf16",
             "needs bitsandbytes and a CUDA device; states quantized block-wise (256)"),
    Strategy("fp16_master", "fp16 params + fp32 master weights (ampdoctor.MasterWeights) + GradScaler", "half",
             "fp16"),
    Strategy("pure_bf16", "pure bf16: bf16 params, gradients and optimizer state", "half", "bf16",
             "updates below half an ulp of the weight are lost (|lr*update| < |w|*2**-9); remedies: Kahan "
             "summation (+2 B/param compensation buffer) or stochastic rounding"),
    Strategy("lora", "LoRA: frozen bf16 base + fp32 adapters, autocast bf16", "lora", "bf16"),
    Strategy("zero1", "ZeRO-1: optimizer state and fp32 masters sharded over N", "half", "bf16"),
    Strategy("zero2", "ZeRO-2: + gradients sharded over N", "half", "bf16"),
    Strategy("zero3", "ZeRO-3: + half weights sharded over N", "half", "bf16"),
    Strategy("fsdp", "FSDP2 fully_shard, bf16 mixed precision, fp32 shards over N", "half", "bf16",
             "one block's parameters are gathered in bf16 at a time"),
)


def sharded_keys() -> tuple[str, ...]:
    """Return the strategies that need more than one device."""
    return ("zero1", "zero2", "zero3", "fsdp")


@dataclass
class ParamInfo:
    """Element counts per parameter tensor (tied tensors once).

    Attributes:
        trainable: numel of each trainable tensor.
        frozen: numel of each frozen tensor.
        adapters: numel of each LoRA adapter tensor (A and B per target), for the ``lora`` strategy.
        largest_block: parameters of the largest repeated block (FSDP gathers one at a time).
    """

    trainable: list[int]
    frozen: list[int] = field(default_factory=list)
    adapters: list[int] = field(default_factory=list)
    largest_block: int = 0

    @property
    def total(self) -> int:
        return sum(self.trainable) + sum(self.frozen)


def optimizer_bytes(numels: Sequence[int], element_size: int, optimizer: str) -> int:
    """Return the optimizer state bytes for tensors of ``numels`` elements stored at ``element_size`` bytes.

    >>> optimizer_bytes([10, 3], 4, "adamw")   # 2 states * 13 * 4 B + one fp32 step per tensor
    112
    >>> optimizer_bytes([4096], 4, "adamw8bit"), optimizer_bytes([100], 4, "adamw8bit")
    (8320, 800)
    """
    if optimizer == "adamw":
        return sum(2 * n * element_size + 4 for n in numels)
    if optimizer == "sgd":
        return sum(n * element_size for n in numels)
    if optimizer == "adamw8bit":
        return sum(2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK) if n >= BNB_MIN_8BIT else 2 * 4 * n for n in numels)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")


def _split(total: int, devices: int) -> int:
    return math.ceil(total / devices)


def model_state_bytes(key: str, info: ParamInfo, optimizer: str, devices: int = 1) -> dict[str, int]:
    """Return ``{weights, gradients, optimizer_state, master_weights}`` in bytes for strategy ``key``, per device.

    >>> model_state_bytes("amp_bf16", ParamInfo([1000]), "adamw")
    {'weights': 4000, 'gradients': 4000, 'optimizer_state': 8004, 'master_weights': 0}
    >>> model_state_bytes("zero2", ParamInfo([1000]), "adamw", devices=4)["gradients"]
    500
    """
    trainable, everything = info.trainable, info.total
    t = sum(trainable)
    opt = "adamw8bit" if key == "amp_bf16_adamw8bit" else optimizer
    if key in ("fp32", "amp_fp16", "amp_bf16", "amp_bf16_checkpoint", "amp_bf16_adamw8bit"):
        return _states(4 * everything, 4 * t, optimizer_bytes(trainable, 4, opt), 0)
    if key == "fp16_master":
        return _states(2 * everything, 4 * t, optimizer_bytes(trainable, 4, opt), 4 * t)
    if key == "pure_bf16":
        return _states(2 * everything, 2 * t, optimizer_bytes(trainable, 2, opt), 0)
    if key == "lora":
        adapters = sum(info.adapters)
        return _states(2 * everything + 4 * adapters, 4 * adapters, optimizer_bytes(info.adapters, 4, opt), 0)
    n = max(1, devices)
    opt_bytes = optimizer_bytes(trainable, 4, opt)
    if key in ("zero1", "zero2", "zero3"):
        weights = 2 * everything if key != "zero3" else _split(2 * everything, n)
        grads = 2 * t if key == "zero1" else _split(2 * t, n)
        return _states(weights, grads, _split(opt_bytes, n), _split(4 * t, n))
    if key == "fsdp":
        return _states(_split(4 * everything, n) + 2 * info.largest_block, _split(4 * t, n), _split(opt_bytes, n), 0)
    raise ValueError(f"unknown strategy {key!r}; one of {[s.key for s in STRATEGIES]}")


def _states(weights: int, gradients: int, optimizer_state: int, master_weights: int) -> dict[str, int]:
    return {"weights": weights, "gradients": gradients, "optimizer_state": optimizer_state,
            "master_weights": master_weights}
