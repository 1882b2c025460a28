"""Turn what the user points at (a module, ``"pkg.mod:factory"``, a transformers config) into a module on meta.

Nothing here allocates the model's weights: a transformers config is built under ``torch.device("meta")``, and a
live module is copied with its parameters and buffers replaced by meta tensors of the same shape and dtype (the
module's structure, hooks and Python attributes are copied; its tensors are not). The caller's module is never
changed.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ModelSource", "load_model", "meta_copy", "unique_parameters"]


@dataclass
class ModelSource:
    """A model on the meta device and what is known about where it came from.

    Attributes:
        model: the module, every parameter and buffer on ``meta``.
        name: a label for reports (the path, factory or class name).
        model_type: the transformers ``config.model_type`` (``"llama"``), or None for other modules.
        from_config: whether it was built from a transformers config (inputs are token ids, the loss is the
            model's own language-model loss).
    """

    model: nn.Module
    name: str
    model_type: str | None = None
    from_config: bool = False


def load_model(source: Any) -> ModelSource:
    """Return a meta-device :class:`ModelSource` for a module, ``"module:callable"``, or a config dir / file.

    >>> load_model(torch.nn.Linear(4, 2)).model.weight.device
    device(type='meta')
    """
    if isinstance(source, nn.Module):
        return ModelSource(meta_copy(source), type(source).__name__, _model_type(source))
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"advise needs an nn.Module, a 'module:callable' factory or a config path, got "
                        f"{type(source).__name__}")
    text = os.fspath(source)
    path = Path(text)
    if path.is_dir() and (path / "config.json").is_file():
        return _from_config(path / "config.json")
    if path.is_file() and path.suffix == ".json":
        return _from_config(path)
    if ":" in text and not path.exists():
        module_name, _, attr = text.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load the factory {text!r}: {exc}") from None
        with torch.device("meta"):  # a factory that builds its layers plainly allocates nothing
            built = factory()
        if not isinstance(built, nn.Module):
            raise TypeError(f"the factory {text!r} returned {type(built).__name__}, not an nn.Module")
        return ModelSource(meta_copy(built), text, _model_type(built))
    raise ValueError(f"{text!r} is neither a folder with config.json, a config .json file, nor 'module:callable'; "
                     "e.g. `ampdoctor advise ./llama-7b/config.json` or `ampdoctor advise mypkg.models:build`")


def _from_config(config_file: Path) -> ModelSource:
    """Build the transformers model that ``config_file`` describes, on meta, with fp32 parameters."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{str(config_file)!r} is a transformers config, but transformers is not installed: "
                         "pip install transformers") from None
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    config = transformers.AutoConfig.from_pretrained(str(config_file.parent))
    architectures = raw.get("architectures") or []
    with torch.device("meta"):
        # fp32 parameters: what training starts from; each strategy then states its own dtypes.
        model = _build(transformers, config, architectures)
    return ModelSource(model, str(config_file), getattr(config, "model_type", None), from_config=True)


def _build(transformers: Any, config: Any, architectures: list[str]) -> nn.Module:
    """Prefer the class the config names, then a causal LM, then the bare model."""
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is not None:
        return cls._from_config(config, dtype=torch.float32)
    try:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError:
        return transformers.AutoModel.from_config(config, dtype=torch.float32)


def _model_type(module: nn.Module) -> str | None:
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None)


def meta_copy(module: nn.Module) -> nn.Module:
    """Return a deep copy of ``module`` whose parameters and buffers are meta tensors (shared ones stay shared).

    >>> m = torch.nn.Linear(3, 3); c = meta_copy(m)
    >>> c.weight.is_meta, m.weight.is_meta, c.weight.requires_grad
    (True, False, True)
    """
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    for m in module.modules():  # plain tensor attributes (not registered) would be copied with their data
        for key, value in vars(m).items():
            if isinstance(value, torch.Tensor) and id(value) not in memo and not key.startswith("_"):
                memo[id(value)] = torch.empty_like(value, device="meta")
    return copy.deepcopy(module, memo)


def unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Return ``(name, parameter)`` once per parameter: tied weights (embedding and head) count once."""
    return list(model.named_parameters(remove_duplicate=True))
