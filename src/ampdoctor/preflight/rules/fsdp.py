"""The FSDP units of a setup's models: what each computes in, what it sums gradients in, over how many ranks.

Shared by the rules on FSDP (AMP205, AMP208, AMP210, AMP211). Nothing here imports ``torch.distributed``: an FSDP
unit can only exist once its module is loaded, so the classes are looked up in ``sys.modules`` (importing
``torch.distributed.fsdp`` costs about a second when nothing else has). The FSDP2 policy and mesh are read in
``ampdoctor._torch.engines``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ampdoctor._torch.engines import fsdp2_policy, fsdp2_reduce_size
from ampdoctor.core.names import module_label
from ampdoctor.core.training import TrainingSetup

__all__ = ["FsdpUnit", "fsdp_units", "loaded_class"]


def loaded_class(module: str, name: str) -> type | None:
    """Return ``module.name`` if that module is already imported, else None (importing nothing)."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


@dataclass(frozen=True)
class FsdpUnit:
    """One FSDP unit that owns parameters: its name, its kind, and how it computes and reduces gradients."""

    name: str
    fsdp2: bool
    param_dtype: torch.dtype | None   # the MixedPrecision(Policy) param_dtype, None when not set
    set_reduce: torch.dtype | None    # the reduce_dtype given, None when not set
    reduce_dtype: torch.dtype         # the dtype the gradients are summed in (the effective one)
    ranks: int | None                 # how many ranks the reduction spans, None if unknown
    sharded: bool                     # False for FSDP1's NO_SHARD (an all-reduce, like DDP)

    @property
    def kind(self) -> str:
        return "fully_shard (FSDP2)" if self.fsdp2 else "FullyShardedDataParallel"

    @property
    def policy(self) -> str:
        """How its policy is spelled in the user's code, with the param_dtype it has."""
        dtype = str(self.param_dtype).removeprefix("torch.")
        return (f"fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype={dtype}))" if self.fsdp2 else
                f"FSDP(mixed_precision=MixedPrecision(param_dtype={dtype}))")


def fsdp_units(setup: TrainingSetup) -> list[FsdpUnit]:
    """Return the FSDP1 and FSDP2 units of the setup's models that own parameters, in model order."""
    fsdp1 = loaded_class("torch.distributed.fsdp", "FullyShardedDataParallel")
    fsdp2 = loaded_class("torch.distributed.fsdp", "FSDPModule")
    if fsdp1 is None and fsdp2 is None:
        return []
    units = []
    for model, prefix in zip(setup.models, setup.prefixes):
        for name, module in model.named_modules():
            label = module_label(name, prefix)
            if fsdp1 is not None and isinstance(module, fsdp1):
                first = next(module.parameters(), None)   # the flat (or original) parameters, in their own dtype
                if first is None:
                    continue
                mp = getattr(module, "mixed_precision", None)
                param, reduce = getattr(mp, "param_dtype", None), getattr(mp, "reduce_dtype", None)
                # FSDP1 (_flat_param.py): reduce_dtype None with param_dtype set reduces in param_dtype
                strategy = str(getattr(getattr(module, "sharding_strategy", None), "name", ""))
                units.append(FsdpUnit(label, False, param, reduce, reduce or param or first.dtype,
                                      getattr(module, "world_size", None), strategy != "NO_SHARD"))
            elif fsdp2 is not None and isinstance(module, fsdp2):
                ranks = fsdp2_reduce_size(module)   # None: the unit owns no parameter group
                first = next(module.parameters(), None)
                if ranks is None or first is None:
                    continue
                param, reduce = fsdp2_policy(module) or (None, None)
                # FSDP2 (_fsdp_param.py): reduce_dtype None reduces in param_dtype, else in the parameters' dtype
                units.append(FsdpUnit(label, True, param, reduce, reduce or param or first.dtype, ranks, True))
    return units
