"""Re-run a recorded forward to explain where it turned non-finite: module frames first, then the ATen op.

Re-run contract. Only when a module's output is non-finite for the first time does the ``ActivationMonitor`` look
closer: it re-runs that forward with hooks that dump abs-min/abs-max frames (like transformers'
``DebugUnderflowOverflow``), then, unless a weight is already non-finite, once more under
:class:`ampdoctor.monitor.op_replay.NonfiniteOpTracer` to name the ATen op. To do so it keeps references to the
root module's positional and keyword inputs of the last root call of each sampled step (a :class:`Replay`), with
the autocast and RNG state at that call, and releases them when the step is recorded. The re-run runs under
``torch.no_grad()`` and the captured autocast state with its weight cache off (older torch let a ``no_grad`` cast
into the user's autocast cache and lose gradients, pytorch#112583), inside ``torch.random.fork_rng`` seeded with
the captured state (same dropout masks), and restores every buffer (BatchNorm statistics) afterwards, so training
is bitwise unaffected. Limits: the re-run sees the weights as they are when the step is recorded (a GradScaler
skips the step on inf, so they are unchanged; without one the optimizer may have stepped), the inputs of the last
root call only (gradient accumulation), and it runs others' forward hooks and Python side effects in ``forward``
once more. A re-run that does not reproduce says so.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ampdoctor._compat.engines import engine_family
from ampdoctor._torch.dispatch import TorchDispatchMode, tree_leaves
from ampdoctor._torch.distributed import distributed_world, process_rank, runs_collectives
from ampdoctor.core.host_reads import HostReads, to_host
from ampdoctor.core.names import module_label
from ampdoctor.core.strict_json import json_float
from ampdoctor.monitor.op_replay import NonfiniteOp, NonfiniteOpTracer

__all__ = ["Replay", "Frame", "rerun", "explain", "render_frames", "replay_blocked"]


class Replay:
    """The root's inputs of one call and the autocast and RNG state it ran with."""

    def __init__(self, args: tuple, kwargs: dict, model_device_type: str | None) -> None:
        self.args, self.kwargs = args, kwargs
        devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        device = next((d for d in devices if d.type != "cpu"), None)
        self.device_type = device.type if device is not None else model_device_type
        types = {"cpu"} | ({self.device_type} if self.device_type else set())
        self.autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in sorted(types)]
        self.cpu_rng = torch.get_rng_state()
        self.device_rng: tuple[int, torch.Tensor] | None = None
        if self.device_type:
            mod = torch.get_device_module(self.device_type)
            index = device.index if device is not None and device.index is not None else mod.current_device()
            self.device_rng = (index, mod.get_rng_state(index))

    def run(self, model: nn.Module, fn: Callable[..., Any]) -> Any:
        """Call ``fn(*args, **kwargs)`` as the step did, leaving RNG, buffers and the autocast cache untouched."""
        saved = [(b, b.detach().clone()) for b in model.buffers()]
        devices = [self.device_rng[0]] if self.device_rng else []
        try:
            with torch.random.fork_rng(devices=devices, device_type=self.device_type), contextlib.ExitStack() as stack:
                torch.set_rng_state(self.cpu_rng)
                if self.device_rng:
                    torch.get_device_module(self.device_type).set_rng_state(self.device_rng[1], self.device_rng[0])
                stack.enter_context(torch.no_grad())
                for device_type, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False))
                return fn(*self.args, **self.kwargs)
        finally:
            with torch.no_grad():
                for buffer, copy in saved:
                    buffer.copy_(copy)


@dataclass(frozen=True)
class Frame:
    """One module's abs-min (smallest non-zero magnitude) and abs-max of its weights, inputs and outputs."""

    name: str
    cls: str
    rows: tuple[tuple[str, str, float, float], ...]  # (kind, role, abs_min_nonzero, abs_max)

    @classmethod
    def measure(cls, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any,
                reads: HostReads | str = "replay") -> "Frame":
        named: list[tuple[str, str, torch.Tensor]] = [
            ("weight", n, p) for n, p in module.named_parameters(recurse=False)]
        named += [("input", f"input[{i}]", t) for i, t in enumerate(args) if isinstance(t, torch.Tensor)]
        named += [("input", k, t) for k, t in kwargs.items() if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        named += [("output", "output" if len(outs) == 1 else f"output[{i}]", t) for i, t in enumerate(outs)]
        named = [(k, r, t) for k, r, t in named if t.is_floating_point() and t.numel()]
        if not named:
            return cls(name, type(module).__name__, ())
        device = named[0][2].device
        stats = []
        for _, _, t in named:
            a = t.detach().abs().float()
            stats += [torch.where(a > 0, a, math.inf).amin().to(device), a.amax().to(device)]
        values = to_host(torch.stack(stats).view(-1, 2), reads)   # one read per frame
        rows = tuple((k, r, 0.0 if hi == 0 else lo, hi) for (k, r, _), (lo, hi) in zip(named, values))
        return cls(name, type(module).__name__, rows)

    def _finite(self, kind: str) -> bool | None:
        values = [hi for k, _, _, hi in self.rows if k == kind]
        return all(math.isfinite(v) for v in values) if values else None

    @property
    def output_finite(self) -> bool:
        return self._finite("output") is not False

    @property
    def inputs_finite(self) -> bool | None:
        return self._finite("input")

    @property
    def weights_finite(self) -> bool | None:
        return self._finite("weight")

    def to_dict(self) -> dict[str, Any]:
        rows = [{"role": r, "abs_min": json_float(lo), "abs_max": json_float(hi)} for _, r, lo, hi in self.rows]
        return {"module": self.name, "class": self.cls, "rows": rows}


def rerun(model: nn.Module, replay: Replay, frames: int, within: HostReads | None = None,
          prefix: str = "") -> tuple[list[Frame], NonfiniteOp | str | None]:
    """Re-run the recorded forward with frame hooks; then, unless a weight is non-finite, at the op level.

    The caller keeps its own hooks quiet meanwhile. Returns the last ``frames`` frames (ending at the first module
    whose output is non-finite, if any) and the op found (or the error text of a failed op-level re-run, or None).
    Each frame is one host read, each op looked at one more, counted as ``"replay"`` reads ``within`` the caller's.
    Frames and ops name modules as `ampdoctor.core.training.module_label` does with ``prefix``.
    """
    reads = HostReads("replay", within=within)
    kept: collections.deque[Frame] = collections.deque(maxlen=max(frames, 1))
    done = []

    def dump(name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not done:
            kept.append(Frame.measure(name, module, args, kwargs, output, reads))
            if not kept[-1].output_finite:
                done.append(True)

    handles = [m.register_forward_hook(functools.partial(dump, module_label(n, prefix)), with_kwargs=True)
               for n, m in model.named_modules()]
    op: NonfiniteOp | str | None = None
    guard = NoCollectives() if distributed_world() > 1 else contextlib.nullcontext()
    try:
        with guard:
            replay.run(model, model)
        for handle in handles:
            handle.remove()
        culprit = kept[-1] if done else None
        if culprit is not None and culprit.weights_finite is not False:
            # finite inputs: the inf arose inside the culprit, so look there only (an inf that some other
            # module makes and masks away is no origin); non-finite inputs: anywhere before it
            within = culprit.name if culprit.inputs_finite is not False else None

            def trace(*args: Any, **kwargs: Any) -> NonfiniteOp | None:
                with NonfiniteOpTracer(model, within=within, reads=reads, prefix=prefix) as tracer:
                    model(*args, **kwargs)
                return tracer.found

            try:
                with guard:
                    op = replay.run(model, trace)
            except Exception as exc:  # the frames are still worth reporting
                op = f"{type(exc).__name__}: {exc}"
    finally:
        for handle in handles:
            handle.remove()
    return list(kept), op


class CollectiveInReplay(RuntimeError):
    """A re-run on one rank reached a collective: it was stopped before the collective started."""


class NoCollectives(TorchDispatchMode):
    """Stop a re-run at its first collective, before it starts.

    ``replay_blocked`` keeps re-runs away from models known to communicate in their forward (DDP, FSDP, DTensor).
    Others do too (``SyncBatchNorm``, a hand-written all-reduce in a forward): on one rank alone that collective
    would wait for ranks that never join it. torch.distributed's collectives, eager (``c10d``) and functional
    (``_c10d_functional``), are dispatcher ops, so this mode sees each before it runs and raises instead.
    """

    NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in self.NAMESPACES:
            raise CollectiveInReplay(
                f"the forward calls a collective ({func}) on rank {process_rank()} of {distributed_world()}; the "
                "re-run stopped before it, so no rank is kept waiting (the forward hooks still name the module)")
        return func(*args, **(kwargs or {}))


def replay_blocked(model: nn.Module) -> str | None:
    """Return why ``model``'s forward must not be re-run on this rank alone, or None when it may be.

    A re-run happens on the rank that saw the non-finite output, and only there. Under DDP (buffer broadcast),
    FSDP (parameter all-gathers) or tensor parallelism (DTensor collectives) the forward enters collectives the
    other ranks never join, and the job hangs. So the re-run is kept to runs with no process group of two or more
    ranks, or a model without a distributed wrapper or DTensor parameters; the forward hooks still name the first
    non-finite module.
    """
    if not runs_collectives(model, engine_family):
        return None
    return (f"Not re-run to dump frames on rank {process_rank()} of {distributed_world()}: the model runs "
            "collectives in its forward (DDP, FSDP or DTensor), and a re-run on this rank alone would wait for ranks "
            "that never join it.")


WEIGHTS_WRITTEN = "Its weights are already non-finite: an earlier optimizer step wrote inf/NaN into them."
# the same, of a module whose weights nothing trains (a frozen teacher, a VAE): no optimizer step wrote them
WEIGHTS_FROZEN = ("Its weights are already non-finite, and nothing trains them: they were loaded or cast that way "
                  "(a weight above 65504 is inf in float16).")


def explain(name: str, label: str, frames: list[Frame], op: NonfiniteOp | str | None, first: dict[str, Any],
            lines: list[str]) -> str | None:
    """Add what the re-runs showed to ``first`` and ``lines``; return a better ``where`` if the op names one.

    Args:
        name, label: the module with the first non-finite output: its name, and ``name (Class)``.
        frames, op: what :func:`rerun` returned.
        first: the ``first_nonfinite_forward`` summary entry, filled in here (``reproduced``, ``frames``, ``op``).
        lines: the AMP601 detail lines, extended here.
    """
    culprit = frames[-1] if frames and not frames[-1].output_finite else None
    first["reproduced"] = culprit is not None and culprit.name == name
    first["frames"] = [f.to_dict() for f in frames]
    where = None
    if isinstance(op, NonfiniteOp):
        first["op"] = op.to_dict()
        lines.append(f"Origin: {op.describe()}")
        if op.module != name:  # made non-finite in a parent's own code, before this module ran
            where = f"{op.module} ({op.module_class})" if op.module_class else op.module
            lines.append(f"The first module with a non-finite output was {label}; its input was made "
                         f"non-finite earlier, by {op.op} in {where}.")
    elif isinstance(op, str):
        lines.append(f"The op-level re-run failed: {op}")
    elif culprit is not None and culprit.weights_finite is False:
        lines.append(WEIGHTS_WRITTEN)
    elif culprit is not None and culprit.inputs_finite is False:
        lines.append("Its input was already non-finite and no op in the model made it so: the inputs given "
                     "to the model hold inf/NaN.")
    if not first["reproduced"]:
        lines.append("The re-run did not reproduce it (the optimizer stepped since, or the inputs changed); "
                     "the frames below are from the re-run.")
    lines.append(render_frames(frames))
    return where


def render_frames(frames: list[Frame]) -> str:
    """Render frames like transformers' DebugUnderflowOverflow: ``abs min  abs max  role`` under each module."""
    lines = ["Frames from a re-run of the forward (abs min skips zeros):", "abs min  abs max  metadata"]
    for frame in frames:
        lines.append(f"{'':18}{frame.name} {frame.cls}")
        lines += [f"{lo:8.2e} {hi:8.2e} {role}" for _, role, lo, hi in frame.rows]
    return "\n".join(lines)


def nonfinite_weights_lines(model: nn.Module, name: str, within: HostReads | None = None) -> list[str]:
    """Return a sentence (in a list) when the module at ``name`` (``model.get_submodule``'s path; ``""``: the root)
    holds inf/NaN in its own parameters, else ``[]``.

    Said when no re-run gives frames (the step's inputs were not kept, or a re-run could hang the ranks): a module
    whose weights are non-finite outputs NaN whatever its input, and no loss scale or upcast of its compute helps.
    Read when the step is recorded, after its optimizer step: the weights may have turned non-finite in this very
    update, so the sentence says "after this step" and leaves the earlier cause as a condition.
    Reads this rank's local values only (a DTensor's local shard): no collective. One host read for that one
    module's parameters, on the error path (a ``"replay"`` read ``within`` the caller's).
    """
    module = model.get_submodule(name)
    params = module.named_parameters(recurse=False)
    own = [(pname, p.to_local() if hasattr(p, "to_local") else p) for pname, p in params]
    own = [(pname, local.detach()) for pname, local in own if local.numel()]
    # one read: the flags gathered on the first parameter's device (a model split over devices: copied there first)
    finite = to_host(torch.stack([torch.isfinite(t).all().to(own[0][1].device) for _, t in own]),
                     HostReads("replay", within=within)) if own else []
    bad = [pname for (pname, _), ok in zip(own, finite) if not ok]
    if not bad:
        return []
    return [f"Its weights hold inf/NaN after this step ({', '.join(bad)}). If an earlier optimizer step wrote them "
            "(Adam's eps at 0 in half precision, AMP104; pure half-precision updates, AMP103; a step taken on inf/NaN "
            "gradients, AMP608), the output is NaN whatever the input."]
