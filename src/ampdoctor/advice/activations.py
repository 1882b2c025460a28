"""Measure activation memory by running one forward and backward on fake tensors, not by a formula.

Method. A fresh meta copy of the model is set up the way the strategy trains it (fp32, half parameters, frozen half
base with fp32 adapters, ``torch.utils.checkpoint`` around each repeated block). Under ``FakeTensorMode`` each
parameter and buffer gets a fake tensor of its shape and dtype, inputs of the requested batch and sequence shape
are made, and the copy runs the forward (under CPU autocast for AMP strategies) and the
backward of the loss. A ``StorageTimeline`` dispatch mode records every storage that an op creates and when it is
freed. After backward, the gradients' storages are known and left out of the replay:

* ``activations`` = the peak of live bytes created during forward and backward, gradients excluded. It includes
  everything the run holds: saved tensors, autocast's half copies of the weights (kept for backward; listed
  separately as ``weight_copies``), dropout masks, logits and the loss's fp32 upcast, backward temporaries.
* ``with_gradients`` = the same peak with the gradients included: during backward, activations are freed while
  gradients appear, so this is less than their sum.

fp16 and bf16 have the same byte sizes and share one autocast list on CUDA, so the bf16 run stands for both.
Measured on CPU (a CPU-only build cannot fake CUDA): CUDA's autocast lists and attention kernels differ (SDPA's
flash/efficient kernels save no attention matrix; CPU's math path may), and the CUDA caching allocator rounds
each block up to 512 B. Not counted: optimizer-step temporaries (``foreach`` AdamW makes a temporary per state
group), CUDA context, cuBLAS workspaces, NCCL buffers, fragmentation.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ampdoctor._torch.fake import StorageTimeline, fake_mode
from ampdoctor.advice.lora import add_adapters_
from ampdoctor.advice.sources import ModelSource, meta_copy

__all__ = ["ActivationBytes", "measure_activations", "repeated_blocks", "default_inputs", "RUNS"]

RUNS = ("fp32", "autocast", "checkpoint", "half", "lora")
InputMaker = Callable[[nn.Module, int, int, torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]


@dataclass
class ActivationBytes:
    """What one fake run measured, in bytes (``error`` set and numbers None when the run failed)."""

    run: str
    activations: int | None
    weight_copies: int | None = None
    with_gradients: int | None = None
    error: str | None = None


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Return the instances of the repeated block class that holds the most parameters (outermost on a tie).

    A transformer's decoder layers, a ResNet's residual blocks, ``nn.TransformerEncoderLayer``s: the unit that
    gradient checkpointing wraps and FSDP shards.

    >>> blocks = repeated_blocks(nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2), 3, enable_nested_tensor=False))
    >>> len(blocks), type(blocks[0]).__name__
    (3, 'TransformerEncoderLayer')
    """
    by_class: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        if module is model or not list(module.children()) or isinstance(module, (nn.ModuleList, nn.Sequential,
                                                                                  nn.ModuleDict)):
            continue
        by_class.setdefault(type(module), []).append(module)
    best: list[nn.Module] = []
    best_size = 0
    for instances in by_class.values():
        if len(instances) < 2:
            continue
        size = sum(p.numel() for m in instances for p in m.parameters())
        if size > best_size:  # strictly larger: the first seen (outermost, modules() is pre-order) wins a tie
            best, best_size = instances, size
    return best


def default_inputs(model: nn.Module, batch: int, seq: int, dtype: torch.dtype) -> tuple[tuple[Any, ...],
                                                                                         dict[str, Any]]:
    """Return ``(args, kwargs)`` for one forward, made in the current (fake) mode.

    A transformers model gets ``input_ids`` and ``labels`` of shape ``(batch, seq)`` (its own language-model loss);
    otherwise the first layer decides: ``Embedding`` -> ids ``(batch, seq)``; ``ConvNd(c)`` -> ``(batch, c, seq,
    ...)`` with ``seq`` as every spatial side; ``Linear(d)`` or ``MultiheadAttention(d)`` -> ``(batch, seq, d)``.
    Pass ``inputs=`` to ``advise`` for anything else.
    """
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vocab_size", None):
        ids = torch.zeros(batch, seq, dtype=torch.long)
        return (ids,), ({"labels": ids} if "labels" in inspect.signature(model.forward).parameters else {})
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return (torch.zeros(batch, seq, dtype=torch.long),), {}
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            spatial = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[type(module)]
            return (torch.zeros(batch, module.in_channels, *[seq] * spatial, dtype=dtype),), {}
        if isinstance(module, nn.Linear):
            return (torch.zeros(batch, seq, module.in_features, dtype=dtype),), {}
        if isinstance(module, nn.MultiheadAttention):
            return (torch.zeros(batch, seq, module.embed_dim, dtype=dtype),), {}
    raise ValueError(f"cannot tell what {type(model).__name__} takes as input; pass inputs=lambda model, batch, seq, "
                     "dtype: ((tensor, ...), {kwargs}) to advise()")


def _loss(output: Any) -> torch.Tensor:
    """The model's own loss when it returns one, else the sum of its first output (in fp32)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict):
        output = next(iter(output.values()))
    while isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor) and hasattr(output, "to_tuple"):
        output = output.to_tuple()[0]
    return output.float().sum()


def _checkpoint_blocks_(model: nn.Module) -> int:
    """Wrap each repeated block's forward in non-reentrant ``torch.utils.checkpoint``; return how many."""
    if getattr(model, "supports_gradient_checkpointing", False) and _transformers_checkpointing_(model):
        return len(repeated_blocks(model))
    blocks = repeated_blocks(model)
    for block in blocks:
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)
    return len(blocks)


def _transformers_checkpointing_(model: nn.Module) -> bool:
    """Turn on a transformers model's own checkpointing of its layers; return False when it has none.

    ``activation_checkpointing_enable`` where the installed transformers has it: 5.x deprecates
    ``gradient_checkpointing_enable`` with a FutureWarning that our call would print on the user's terminal.
    ``use_cache`` is turned off on this copy, as transformers does itself when it checkpoints a training forward,
    without the warning it logs then.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        return False
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False
    return True


def prepared_copy(source: ModelSource, run: str, *, half: torch.dtype = torch.bfloat16,
                  lora: tuple[list[tuple[str, int, int]], int] | None = None) -> nn.Module:
    """Return a meta copy of the model set up for ``run`` (one of ``RUNS``), in training mode."""
    model = meta_copy(source.model)
    if run in ("half", "lora"):
        model.to(half)
    if run == "lora":
        targets, rank = lora or ([], 8)
        add_adapters_(model, targets, rank, torch.float32)
    if run == "checkpoint":
        _checkpoint_blocks_(model)
    return model.train()


def measure_activations(source: ModelSource, run: str, batch: int, seq: int, *, half: torch.dtype = torch.bfloat16,
                        lora: tuple[list[tuple[str, int, int]], int] | None = None,
                        inputs: InputMaker | None = None) -> ActivationBytes:
    """Run one fake forward and backward of ``source`` set up for ``run``; return what it kept alive.

    >>> m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    >>> r = measure_activations(ModelSource(m.to("meta"), "mlp"), "fp32", 8, 16)
    >>> r.activations >= 8 * 16 * 256 * 4   # at least the hidden layer's output, saved for backward
    True
    """
    if run not in RUNS:
        raise ValueError(f"run must be one of {RUNS}, got {run!r}")
    try:
        model = prepared_copy(source, run, half=half, lora=lora)
        return _fake_run(model, run, batch, seq, half, inputs or default_inputs)
    except Exception as exc:  # an op without a fake kernel, a model that needs other inputs: say so, no number
        return ActivationBytes(run, None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def _fake_run(model: nn.Module, run: str, batch: int, seq: int, half: torch.dtype,
              inputs: InputMaker) -> ActivationBytes:
    mode = fake_mode()
    fakes: dict[int, nn.Parameter] = {}
    buffers: list[torch.Tensor] = []
    with mode:
        # The copy is ours: its meta tensors are replaced for good (checkpointing recomputes the forward in
        # backward, so swapping them back after the forward, as functional_call does, would be too early).
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if id(p) not in fakes:
                    fakes[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                setattr(module, name, fakes[id(p)])
            for name, b in list(module.named_buffers(recurse=False)):
                fake = torch.empty(b.shape, dtype=b.dtype)
                setattr(module, name, fake)  # an existing buffer stays one, persistent or not
                buffers.append(fake)
        args, kwargs = inputs(model, batch, seq, half if run == "half" else torch.float32)
    known = [*fakes.values(), *buffers, *(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))]
    timeline = StorageTimeline(known)
    with mode, timeline:
        with torch.autocast("cpu", dtype=half, enabled=run in ("autocast", "checkpoint", "lora")):
            output = model(*args, **kwargs)
            loss = _loss(output)
        del output
        loss.backward()
    grads = timeline.serials(p.grad for p in fakes.values())
    copies = timeline.peak(only=timeline.copies_of_known)  # autocast's half weights, at their most at once
    return ActivationBytes(run, timeline.peak(exclude=grads), weight_copies=copies,
                           with_gradients=timeline.peak())
