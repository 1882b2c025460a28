"""How explanations name things: an optimizer, a tensor, a bounded list of names."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Mapping, Sequence

import torch

from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.training import TrainingSetup, model_prefixes, note_script_names, optimizer_slots

_MAX_NAMES = 10          # names listed in one finding


def with_scaler(setup: TrainingSetup, scaler: Any) -> TrainingSetup:
    """Return ``setup``, or a copy that includes ``scaler`` when it has none (checks may need it)."""
    if scaler is None or setup.scaler is not None:
        return setup
    return TrainingSetup(setup.models, setup.optimizers, scaler, setup.autocast_dtype, setup.accelerator)


def with_script_names(setup: TrainingSetup, namespaces: Iterable[Mapping[str, Any]]) -> TrainingSetup:
    """Return ``setup``, or a copy named again when ``namespaces`` (the locals of a crash's frames, outermost first)
    give names to models it named by their class: a crash is explained after the script's module is gone."""
    note_script_names(setup.models, namespaces)
    return setup if model_prefixes(setup.models) == setup.prefixes else replace(setup)


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_NAMES])
    return shown + (f" and {len(items) - _MAX_NAMES} more" if len(items) > _MAX_NAMES else "")


def optimizer_label(optimizer: Any, setup: TrainingSetup) -> str:
    """Return ``optimizer[0] (AdamW)``, numbered as in ``setup.optimizers``."""
    for i, opt in enumerate(setup.optimizers):
        if opt is optimizer:
            return f"optimizer[{i}] ({type(optimizer).__name__})"
    return f"optimizer ({type(optimizer).__name__})"


def _tensor_name(t: torch.Tensor, setup: TrainingSetup, optimizer: Any = None) -> str:
    info = setup.info(t)
    if info is not None:
        return info.describe()
    where = optimizer_slots(optimizer).get(id(t), "not in the model")
    return f"{where} ({dtype_name(t)}, {list(t.shape)})"
