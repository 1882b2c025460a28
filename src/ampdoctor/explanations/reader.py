"""Read an exception's traceback: the GradScaler, optimizer, parameter and modules that were executing when it was
raised, the user's frames, and the models and optimizers those frames hold.

Frame locals are read through ``ampdoctor._torch.frames``; nothing here is kept past the explanation.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from ampdoctor._compat.loss_scalers import loss_scaler_shape
from ampdoctor._torch.frames import clip_parameters, frame_self, frame_values, scaler_frame_tensors
from ampdoctor.core.callsite import is_user_file
from ampdoctor.core.training import TrainingSetup


@dataclass
class _Crash:
    """What the traceback of one exception shows: the objects that were executing when it was raised."""

    exc: BaseException
    scaler: Any = None
    optimizer: torch.optim.Optimizer | None = None
    param: torch.Tensor | None = None                        # `_unscale_grads_`'s loop variable
    modules: list[tuple[nn.Module, FrameType]] = field(default_factory=list)   # innermost first
    clip_params: list[torch.Tensor] | None = None
    user_frames: list[FrameType] = field(default_factory=list)                 # innermost first
    loss_scaler: Any = None   # a library's own loss scaler that raised (fairseq's, DeepSpeed's: `_compat.loss_scalers`)

    @classmethod
    def of(cls, exc: BaseException) -> "_Crash":
        crash = cls(exc)
        frames: deque[FrameType] = deque(maxlen=400)
        tb = exc.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):
            crash._read_frame(frame)
        # The frames that called explain (e.g. the loop that caught the error) hold the model too.
        caller = sys._getframe(1)
        for _ in range(20):
            if caller is None:
                break
            if is_user_file(caller.f_code.co_filename):
                crash.user_frames.append(caller)
            caller = caller.f_back
        return crash

    def _read_frame(self, frame: FrameType) -> None:
        """Note what one traceback frame shows, innermost first: the first scaler, optimizer and parameter, a
        module, the clipped parameters, a user's frame."""
        owner = frame_self(frame)
        if isinstance(owner, torch.amp.GradScaler):
            self.scaler = self.scaler or owner
            opt, param = scaler_frame_tensors(frame)
            if self.optimizer is None:
                self.optimizer = opt
            if self.param is None:
                self.param = param
        elif isinstance(owner, nn.Module):
            self.modules.append((owner, frame))
        elif self.loss_scaler is None and loss_scaler_shape(owner) is not None:
            self.loss_scaler = owner
        clipped = clip_parameters(frame)
        if clipped is not None:
            self.clip_params = self.clip_params or clipped
        if is_user_file(frame.f_code.co_filename):
            self.user_frames.append(frame)

    @property
    def site(self) -> str:
        """``file:line`` of the innermost frame outside torch and ampdoctor."""
        tb, site = self.exc.__traceback__, "<unknown>"
        while tb is not None:
            if is_user_file(tb.tb_frame.f_code.co_filename):
                site = f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
            tb = tb.tb_next
        return site

    def user_locals(self) -> Iterable[tuple[str, Any]]:
        for frame in self.user_frames:
            yield from frame_values(frame)

    def namespaces(self) -> Iterator[dict[str, Any]]:
        """Yield the local variables of each user's frame, outermost first (the script's module before its
        ``main()``)."""
        for frame in reversed(self.user_frames):
            yield dict(frame_values(frame))

    def guess_setup(self) -> TrainingSetup:
        """Build a setup from the models, optimizers and scaler found in the user's frames."""
        modules: dict[int, nn.Module] = {}
        optimizers: dict[int, torch.optim.Optimizer] = {}
        scaler = self.scaler
        for _, value in self.user_locals():
            if isinstance(value, nn.Module):
                modules.setdefault(id(value), value)
            elif isinstance(value, torch.optim.Optimizer):
                optimizers.setdefault(id(value), value)
            elif scaler is None and isinstance(value, torch.amp.GradScaler):
                scaler = value
        if self.optimizer is not None:
            optimizers.setdefault(id(self.optimizer), self.optimizer)
        nested = {id(sub) for m in modules.values() for sub in m.modules() if sub is not m}
        roots = [m for k, m in modules.items() if k not in nested]
        if len(roots) > 1:   # keep the models involved in the crash
            involved = {id(m) for m, _ in self.modules}
            tensors = {id(t) for t in self.clip_params or ()}
            tensors |= {id(p) for o in optimizers.values() for g in o.param_groups for p in g["params"]}
            roots = [m for m in roots if any(id(sub) in involved for sub in m.modules())
                     or any(id(p) in tensors for p in m.parameters())] or roots
        return TrainingSetup(roots, list(optimizers.values()), scaler)

    def variable_name(self, obj: Any) -> str | None:
        for name, value in self.user_locals():
            if value is obj and not name.startswith("."):
                return name
        return None
