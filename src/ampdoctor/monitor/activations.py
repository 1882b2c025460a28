"""Watch every module's outputs and output gradients for inf/NaN, and for headroom below the fp16 maximum.

Cost model. On a sampled step each module's forward hook runs one ``torch.aminmax`` per floating-point output (no
copy, no host sync) and keeps the two 0-d results; outputs that require grad get a ``Tensor.register_hook`` probe
that does the same for their gradient. ``step_record()`` copies everything to the host in one read, then finds
the first non-finite value in call order and in backward order. Unsampled steps: one bool check per hook.
Compiled code is not looked into: a hook traced by ``torch.compile`` would change the graph (what it reads must be
materialised), so every hook returns at once while dynamo traces it. Re-run contract: on a module's first
non-finite output the monitor re-runs that forward (never where it runs collectives); ``ampdoctor.monitor.replay``
says what it keeps and why training is bitwise unaffected.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from typing import Any, Sequence

import torch
from torch import nn

from ampdoctor._torch.autograd import in_backward
from ampdoctor._torch.dispatch import tree_leaves
from ampdoctor._torch.distributed import process_rank
from ampdoctor.core.catalog import get_rule
from ampdoctor.core.dtypes import dtype_name
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.host_reads import HostReads
from ampdoctor.core.isolation import internal_error_finding
from ampdoctor.core.names import module_label
from ampdoctor.core.options import check_every
from ampdoctor.core.records import ActivationModule, ActivationSummary, FirstNonfinite
from ampdoctor.explanations.fixes import frozen_half_fix, frozen_weights_fix, nonfinite_weights_fix
from ampdoctor.monitor.activation_records import StepRecord, abs_max, abs_max_on_device, scale_note, split
from ampdoctor.monitor.replay import (
    WEIGHTS_FROZEN,
    WEIGHTS_WRITTEN,
    Frame,
    NonfiniteOp,
    Replay,
    explain,
    nonfinite_weights_lines,
    replay_blocked,
    rerun,
)

__all__ = ["ActivationMonitor", "HEADROOM_FACTOR"]

# Flag a module whose output reaches 1/8 of the format's maximum (fp16: 65504 / 8 = 8188). 8 = 2**3 leaves three
# doublings, and each is routinely spent: Dropout(p=0.5) rescales by 1/(1-p) = 2, a residual add of two branches
# of similar size doubles, and activations keep growing as weights grow during training. transformers' T5 dump
# shows exactly this: 6.27e4 out of a Linear, inf out of the Dropout after it.
HEADROOM_FACTOR = 8.0
FRAMES = 5  # frames dumped: the culprit and the modules that ran just before it
MAX_REPLAYS = 3  # re-runs for the first distinct culprits; later ones are reported without frames
MAX_PENDING = 1 << 16  # values held for one step; a driver that never calls step_record() cannot grow memory
_LIMIT_NAMES = {torch.finfo(d).max: dtype_name(d) for d in (torch.bfloat16, torch.float16)}
INPUTS = -1  # the module index under which the root call's input tensors are recorded (-1 - r for root r)


class ActivationMonitor:
    """Find the first module whose output or output gradient became inf/NaN, and activations near overflow.

    Args:
        model: the module to watch; every submodule from ``model.named_modules()`` gets a forward hook.
        every: look at every ``every``-th call of ``model`` (1: all); a driver (``watch``) calls ``set_sampling``.
        setup: the run's ``TrainingSetup``; its scaler is named in gradient findings (gradients are scaled).
        scaler: the run's GradScaler, when no ``setup`` is given (a watch's).
        headroom: flag AMP606 when a module's output abs-max exceeds the format's maximum divided by this.
        frames: how many module frames to dump when a forward turns non-finite.
        reads: the owner this monitor's host reads also count for (a ``Watch``'s ``reads``; ``core.host_reads``).
        prefix: what the run's names of the model's modules start with when it has several models (``netD.``:
            ``core.training.model_prefixes``), so that the findings name them as the gradient table does.
        others: the run's other models, with their prefixes, watched alongside ``model``: the first non-finite
            output in call order may be theirs (a GAN's generator feeding the critic ``model``), and an input of
            ``model`` that one of them made inf is then no bad data (AMP609).
        gradients: also probe each output's gradient (AMP602). ``False`` looks at the forward alone (AMP601,
            AMP609, AMP606): a watch's dense-start look, which reports only the first non-finite output, skips the
            backward probes (on the bench model they cost 1.9 ms of its 6 ms a step, one thread).

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> with ActivationMonitor(model) as monitor:
    ...     _ = model(torch.ones(2, 4))
    ...     record = monitor.step_record()
    >>> record["sampled"], monitor.first_nonfinite_module
    (True, None)
    """

    def __init__(self, model: nn.Module, *, every: int = 1, setup: Any = None, headroom: float = HEADROOM_FACTOR,
                 frames: int = FRAMES, reads: HostReads | None = None, gradients: bool = True,
                 prefix: str = "", others: Sequence[tuple[nn.Module, str]] = (), scaler: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}: {model!r:.80}")
        check_every(every)
        if not headroom > 1:
            raise ValueError(f"headroom must be a factor above 1, got {headroom!r}; the default is {HEADROOM_FACTOR}")
        self._model, self.reads = weakref.ref(model), HostReads("activations", within=reads)
        self.every, self.headroom, self.frames, self.gradients = every, float(headroom), frames, gradients
        self.prefix = prefix
        # the roots whose forwards are looked at: the model, then the run's other models (weakly, with their prefixes)
        self._roots = [(self._model, prefix), *((weakref.ref(m), p) for m, p in others)]
        # the setup holds the model: keep only a weak reference to its scaler, so the monitor never pins the model
        scaler = getattr(setup, "scaler", None) if scaler is None else scaler
        self._scaler = weakref.ref(scaler) if scaler is not None else lambda: None
        self.first_nonfinite_module: str | None = None
        self._handles: list[Any] = []
        self._active = self._driven = self._broken = self._replaying = False  # _active: the flag every hook checks
        self._calls = self._records = self._sampled = self._replays = 0
        self.seconds = 0.0  # spent in the forward hooks of sampled steps (a watch counts it as its own)
        self._record: StepRecord | None = None
        self._findings: list[Finding] = []
        self._reported: set[tuple[str, int]] = set()
        self._unexplained: dict[int, Finding] = {}  # AMP601 by module, found on a step without its inputs
        self._first: dict[str, dict[str, Any] | None] = {"forward": None, "backward": None}
        self._error: str | None = None
        self._index_modules()

    # ---- attaching ------------------------------------------------------------------------------------------
    def _index_modules(self) -> None:
        """Number the modules of every root in ``named_modules()`` order, one root after the other."""
        self._names, self._paths, self._classes, self._descendants = [], [], [], []
        self._root_of: list[int] = []   # the root each module belongs to
        self._starts: list[int] = []    # the index of each root's own module
        devices: set[str] = set()
        for r, (ref, prefix) in enumerate(self._roots):
            model = ref()
            named = [] if model is None else list(model.named_modules())
            start = len(self._names)
            self._starts.append(start)
            self._names += [module_label(name, prefix) for name, _ in named]   # as the findings name them
            self._paths += [name for name, _ in named]   # as get_submodule() finds them in their root
            self._classes += [type(m).__name__ for _, m in named]
            self._root_of += [r] * len(named)
            position = {id(m): start + k for k, (_, m) in enumerate(named)}
            self._descendants += [[position[id(d)] for d in m.modules() if d is not m and id(d) in position]
                                  for _, m in named]
            devices |= {p.device.type for p in (model.parameters() if model is not None else ())}
        self._max_abs: list[float | None] = [None] * len(self._names)
        self._limit: list[float | None] = [None] * len(self._names)
        self._nonfinite = [[0, 0] for _ in self._names]  # steps with a non-finite output, gradient
        self._device_type = min(devices - {"cpu", "meta"}, default=None)

    def attach(self) -> "ActivationMonitor":
        """Register the hooks; return ``self``. Attaching twice is a no-op."""
        if self._handles or self._broken:
            return self
        self._require_model()
        roots = [ref() for ref, _ in self._roots]
        if len(self._names) != sum(sum(1 for _ in m.named_modules()) for m in roots if m is not None):
            self._index_modules()  # a model changed since construction
        for r, model in enumerate(roots):
            if model is None:
                continue
            for k, (_, module) in enumerate(model.named_modules()):
                self._handles.append(module.register_forward_hook(functools.partial(self._on_forward,
                                                                                    self._starts[r] + k)))
            # prepend: capture the inputs before other pre-hooks (FSDP input casts) change them; the re-run runs them
            self._handles.append(model.register_forward_pre_hook(functools.partial(self._on_root_call, r),
                                                                 with_kwargs=True, prepend=True))
        return self

    def detach(self, record: bool = True) -> None:
        """Record a pending step (unless ``record`` is False: a watch's part that stepped aside), then remove every
        hook this monitor registered."""
        if record and self._record is not None and not self._broken:
            try:
                self._close(None)
            except Exception as exc:
                self._fail(exc)
        self._remove_hooks()

    def __enter__(self) -> "ActivationMonitor":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    @property
    def enabled(self) -> bool:
        """Whether the hooks are attached and the monitor has not switched itself off."""
        return bool(self._handles) and not self._broken

    def set_sampling(self, active: bool) -> None:
        """Look at the coming step(s) (``True``) or let every hook return at once (``False``)."""
        self._driven = True
        self._active = bool(active) and self.enabled and not self._replaying

    # ---- hooks ----------------------------------------------------------------------------------------------
    def _on_root_call(self, root: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() or self._broken or self._replaying:
            return None
        try:
            if root:   # another model of the run: looked at while the model's steps are
                if self._active:
                    self._record_inputs(root, args, kwargs)
                return None
            if not self._driven:
                if self._record is not None:  # the previous sampled step's backward is done by now
                    self._close(None)
                self._active = self._calls % self.every == 0 and self.enabled
            elif self._record is not None and len(self._record.fwd) > MAX_PENDING:
                self._close(None)
            self._calls += 1
            if self._active:
                self._record_inputs(root, args, kwargs)
        except Exception as exc:
            self._fail(exc)
        return None

    def _record_inputs(self, root: int, args: tuple, kwargs: dict) -> None:
        rec = self._open()
        rec.replay[root] = Replay(args, kwargs, self._device_type)
        # the root's inputs first, in call order: a NaN fed in is bad input, not the first layer's fault
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel():
                rec.add_output(INPUTS - root, leaf)

    def _on_forward(self, index: int, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._active:  # see the module docstring
            return None
        start = time.perf_counter()
        try:
            self._forward_stats(index, output)
        except Exception as exc:
            self._fail(exc)
        self.seconds += time.perf_counter() - start
        return None

    def _forward_stats(self, index: int, output: Any) -> None:
        if in_backward():  # activation checkpointing recomputes forwards in backward
            return
        rec = self._record if self._record is not None else self._open()
        tensors = (output,) if isinstance(output, torch.Tensor) else [
            t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.is_floating_point() and t.numel():
                rec.add_output(index, t)
        if index in self._starts:
            rec.last = None  # a root's hook runs last: drop the reference to its output

    # ---- recording ------------------------------------------------------------------------------------------
    def _open(self) -> StepRecord:
        if self._record is None:
            self._record = StepRecord(self._records if self._driven else max(self._calls - 1, 0), self.gradients)
        return self._record

    def step_record(self, step: int | None = None, values: list[float] | None = None) -> dict[str, Any]:
        """Close the current step and return its JSON-ready statistics, read from the device in one host read.

        Call it after ``backward()`` (and the optimizer step). ``step`` overrides the monitor's own count.
        ``values``: the host copy of :meth:`pending`, made by an owner together with its own values (then this
        monitor makes no read of its own)."""
        if self._broken:
            return {"step": step, "sampled": False, "error": self._error}
        try:
            return self._close(step, values)
        except Exception as exc:
            self._fail(exc)
            return {"step": step, "sampled": False, "error": self._error}

    def pending(self) -> dict[str, torch.Tensor]:
        """Return the device values :meth:`step_record` reads for the current step (``{}`` when there are none),
        for an owner to copy to the host with its own and hand back as ``step_record(values=...)``."""
        rec = self._record
        if self._broken or rec is None:
            return {}
        values = abs_max_on_device(rec.fwd, rec.bwd)
        return {} if values is None else {"abs_max": values}

    def _close(self, step: int | None, values: list[float] | None = None) -> dict[str, Any]:
        rec, self._record = self._record, None
        self._records += 1
        if rec is None:
            return {"step": step if step is not None else self._records - 1, "sampled": False}
        rec.closed, rec.last = True, None
        if step is not None:
            rec.step = step
        self._sampled += 1
        if values is not None and len(values) == len(rec.fwd) + len(rec.bwd):  # copied with the owner's values
            fwd, bwd = split((rec.fwd, rec.bwd), values)
        else:
            fwd, bwd = abs_max(rec.fwd, rec.bwd, reads=self.reads)  # the one host read of a sampled step
        if rec.errors:
            raise rec.errors[0]
        step_max = self._track_forward_max(rec, fwd)
        self._count_nonfinite(rec, fwd, bwd)
        worst = self._check_headroom(rec.step, step_max)
        first_fwd = next((k for k, v in enumerate(fwd) if not math.isfinite(v)), None)
        first_bwd = next((k for k, v in enumerate(bwd) if not math.isfinite(v)), None)
        if first_fwd is not None and rec.fwd_modules[first_fwd] < 0:
            self._nonfinite_input(rec, INPUTS - rec.fwd_modules[first_fwd], fwd[first_fwd])
        elif first_fwd is not None:
            self._nonfinite_forward(rec, rec.fwd_modules[first_fwd], fwd[first_fwd])
        elif first_bwd is not None:  # with a non-finite forward every gradient is garbage: AMP601 explains it
            self._nonfinite_backward(rec, first_bwd, bwd)
        summary = self._step_summary(rec, fwd, bwd, first_fwd, first_bwd, worst)
        rec.replay = {}
        rec.fwd, rec.bwd = [], []  # probes of outputs the user keeps alive still hold `rec`: let the values go
        return summary

    def _track_forward_max(self, rec: StepRecord, fwd: list[float]) -> dict[int, float]:
        """Fold a step's forward abs-max values into each module's running maximum and format limit; return the
        step's own finite maximum per module (the model's inputs left out)."""
        step_max: dict[int, float] = {}
        for i, value, limit in zip(rec.fwd_modules, fwd, rec.fwd_limits):
            if i < 0:   # a root's inputs
                continue
            if limit is not None:
                self._limit[i] = limit if self._limit[i] is None else min(self._limit[i], limit)
            if math.isfinite(value):
                step_max[i] = max(step_max.get(i, 0.0), value)
                self._max_abs[i] = max(self._max_abs[i] or 0.0, value)
        return step_max

    def _count_nonfinite(self, rec: StepRecord, fwd: list[float], bwd: list[float]) -> None:
        """Count, per module, the sampled steps with a non-finite output (forward) or gradient (backward)."""
        for i in {i for i, v in zip(rec.fwd_modules, fwd) if not math.isfinite(v) and i >= 0}:
            self._nonfinite[i][0] += 1
        for i in {m[0] for m, v in zip(rec.bwd_modules, bwd) if not math.isfinite(v)}:
            self._nonfinite[i][1] += 1

    def _step_summary(self, rec: StepRecord, fwd: list[float], bwd: list[float], first_fwd: int | None,
                      first_bwd: int | None, worst: dict[str, Any] | None) -> dict[str, Any]:
        """Return a closed step's statistics, JSON-ready: the largest finite values and the first non-finite
        module of each direction, the module closest to its format's maximum, and whether the look began at the
        model's call (``inputs``; False: the monitor was attached inside the forward, which ran partly unseen)."""
        if first_fwd is None:
            fwd_module = None
        elif rec.fwd_modules[first_fwd] < 0:
            fwd_module = self._input_name(INPUTS - rec.fwd_modules[first_fwd])
        else:
            fwd_module = self._names[rec.fwd_modules[first_fwd]]
        bwd_module = None if first_bwd is None else self._names[rec.bwd_modules[first_bwd][0]]
        finite_f, finite_b = [v for v in fwd if math.isfinite(v)], [v for v in bwd if math.isfinite(v)]
        return {
            "step": rec.step, "sampled": True,
            "forward": {"values": len(fwd), "max_abs": max(finite_f, default=None), "nonfinite_module": fwd_module,
                        "inputs": self._calls_seen(rec)},
            "backward": {"values": len(bwd), "max_abs": max(finite_b, default=None), "nonfinite_module": bwd_module},
            "headroom": worst,
        }

    def _calls_seen(self, rec: StepRecord) -> bool:
        """Whether the look began at the call of every root it saw a module of (False: the monitor was attached
        inside a forward, which ran partly unseen, and its first non-finite output may come from unseen inputs)."""
        roots = {self._root_of[i] if i >= 0 else INPUTS - i for i in rec.fwd_modules}
        return bool(rec.replay) and roots <= rec.replay.keys()

    def _check_headroom(self, step: int, step_max: dict[int, float]) -> dict[str, Any] | None:
        worst: tuple[float, int] | None = None
        for i, value in step_max.items():
            limit = self._limit[i]
            if limit is None:
                continue
            ratio = value / limit
            if worst is None or ratio > worst[0]:
                worst = (ratio, i)
            # a container whose output is a child's output only carries it along: blame the child
            if ratio * self.headroom <= 1 or any(step_max.get(d, 0.0) >= value for d in self._descendants[i]):
                continue
            self._report("AMP606", i, Severity.WARNING, step,
                         f"output abs-max {value:.6g} is {ratio:.1%} of the {_LIMIT_NAMES.get(limit, 'format')} "
                         f"maximum {limit:.6g} (flagged above 1/{self.headroom:g} of it) at step {step}; "
                         f"{limit / value:.1f}x more and it overflows to inf")
        return None if worst is None else {"module": self._names[worst[1]], "ratio": worst[0]}

    def _input_name(self, root: int) -> str:
        """Return how a step record names root ``root``'s inputs: ``(input)`` for the model's, else with the other
        model's name (``(input of netG)``)."""
        return "(input)" if root == 0 else f"(input of {self._names[self._starts[root]]})"

    def _nonfinite_input(self, rec: StepRecord, root: int, value: float) -> None:
        kind = "NaN" if math.isnan(value) else "inf"
        if ("AMP609", INPUTS - root) in self._reported:
            return
        if self._unexplained:   # AMP601 named from a step without its inputs: they were bad, not the module
            self._withdraw_unexplained()
        self._first["forward"] = self._first["forward"] or {**dict.fromkeys(("class", "frames", "op", "reproduced")),
                                                           "module": self._input_name(root), "step": rec.step,
                                                           "kind": kind.lower()}
        # the live roots, as the findings name them: the watched model is "the model" when the run names it no other
        live = [self._names[start] if self._names[start] != "(root)" else "the model"
                for r, start in enumerate(self._starts) if self._root_of[start:start + 1] == [r]]
        model = "the model" if len(live) == 1 or root == 0 and live[0] == "the model" else \
            self._names[self._starts[root]]
        before = "any module ran" if len(live) == 1 else (
            f"any of its modules ran, and no module of the run's models ({', '.join(live)}) produced it before")
        self._report("AMP609", INPUTS - root, Severity.ERROR, rec.step,
                     f"an input tensor of {model} holds {kind} at step {rec.step}, before {before}: the data (or "
                     "the code that prepares a batch) produced it, and every output after it is garbage. No layer or "
                     "loss scale is at fault.", where="model input" if model == "the model" else f"{model} input")

    def _withdraw_unexplained(self) -> None:
        """Take back the AMP601 named from steps whose forward was seen in part: a step seen whole showed the
        inf/NaN arising before them."""
        self._findings = [f for f in self._findings if f not in self._unexplained.values()]
        for j in self._unexplained:
            self._reported.discard(("AMP601", j))
        self._unexplained, self._first["forward"], self.first_nonfinite_module = {}, None, None

    def _nonfinite_forward(self, rec: StepRecord, i: int, value: float) -> None:
        kind = "NaN" if math.isnan(value) else "inf"
        if any(j != i for j in self._unexplained) and self._calls_seen(rec):
            # named from a forward seen in part (attached inside it); this one, seen whole, shows where the inf/NaN
            # first arises: an earlier module, whose inf/NaN the one named before only carried along
            self._withdraw_unexplained()
        if self.first_nonfinite_module is None:
            self.first_nonfinite_module = self._names[i]
        earlier = self._unexplained.get(i)  # reported from a step whose inputs were not kept (attached mid-forward)
        root = self._root_of[i]
        replay, model = rec.replay.get(root), self._require_root(root)
        if ("AMP601", i) in self._reported and (earlier is None or replay is None):
            return
        step = rec.step if earlier is None else earlier.step
        rank = process_rank()  # with several ranks, name the one that saw it: the others may not have
        first = {"module": self._names[i], "class": self._classes[i], "step": step, "kind": kind.lower(),
                 "frames": None, "op": None, "reproduced": None, "rank": rank}
        lines = [f"output {kind} at step {step}{'' if rank is None else f' on rank {rank}'}: the first module, in "
                 "call order, whose output is not finite; the modules after it only carry it along."]
        where, blocked = self._label(i), replay is not None and replay_blocked(model)
        lines += [blocked] if blocked else []
        weights: list[str] = []   # said when no re-run gave frames and its own weights are non-finite
        if not blocked and replay is not None and self._replays < MAX_REPLAYS:
            self._replays += 1
            try:
                frames, op = self._diagnose(root, replay)
            except Exception as exc:  # a failed re-run costs the frames, not the monitor
                lines.append(f"Re-running the forward to dump frames failed: {type(exc).__name__}: {exc}")
                weights = nonfinite_weights_lines(model, self._paths[i], self.reads)
            else:
                where = explain(self._names[i], self._label(i), frames, op, first, lines) or where
        else:  # no frames: say at least whether its own weights are already non-finite
            weights = nonfinite_weights_lines(model, self._paths[i], self.reads)
        lines += weights
        fix = self._forward_fix(i, bool(weights) or WEIGHTS_WRITTEN in lines, lines)
        if earlier is not None:  # the re-run of a later step replaces the unexplained finding: one AMP601 here
            self._findings.remove(self._unexplained.pop(i))
            self._reported.discard(("AMP601", i))
        self._first["forward"] = first if earlier is not None else self._first["forward"] or first
        finding = self._report("AMP601", i, Severity.ERROR, step, "\n".join(lines), where=where, fix=fix)
        if replay is None and finding is not None:
            self._unexplained[i] = finding

    def _nonfinite_backward(self, rec: StepRecord, k: int, bwd: list[float]) -> None:
        i, value = rec.bwd_modules[k][0], bwd[k]
        kind = "NaN" if math.isnan(value) else "inf"
        if self.first_nonfinite_module is None:
            self.first_nonfinite_module = self._names[i]
        if k == 0:
            origin = ("It is the first gradient of the backward pass, so it came straight from the loss: the loss "
                      "(times the loss scale) overflows.")
            upstream = None
        else:
            upstream = self._names[rec.bwd_modules[k - 1][0]]
            origin = (f"The gradient was still finite (abs-max {bwd[k - 1]:.3g}) at the output of "
                      f"{self._label(rec.bwd_modules[k - 1][0])}, just before in backward order, so the backward "
                      f"of what consumes this module's output made it {kind}.")
        self._first["backward"] = self._first["backward"] or {
            "module": self._names[i], "class": self._classes[i], "step": rec.step, "kind": kind.lower(),
            "upstream": upstream}
        self._report("AMP602", i, Severity.WARNING, rec.step,
                     f"the gradient w.r.t. its output is {kind} at step {rec.step}: the first non-finite gradient "
                     f"in backward order, with a finite forward pass. {origin}{scale_note(self._scaler(), self.reads)}")

    def _diagnose(self, root: int, replay: Replay) -> tuple[list[Frame], NonfiniteOp | str | None]:
        """Re-run root ``root``'s recorded forward (``ampdoctor.monitor.replay.rerun``) with this monitor's hooks
        quiet."""
        model = self._require_root(root)
        active, self._active, self._replaying = self._active, False, True
        try:
            return rerun(model, replay, self.frames, self.reads, self._roots[root][1])
        finally:
            self._active, self._replaying = active and self.enabled, False

    # ---- results --------------------------------------------------------------------------------------------
    def findings(self) -> list[Finding]:
        """Return the findings so far: AMP601, AMP602, AMP606, and AMP001 if the monitor hit an internal error."""
        return list(self._findings)

    def section(self, culprit: str | None = None) -> ActivationSummary:
        """Return the activations' section of a watch summary: per-module max abs seen, headroom ratio, the first
        non-finite forward and backward (``culprit``: the module the first AMP601 names, as it names it)."""
        modules = {}
        for i, name in enumerate(self._names):
            seen, limit = self._max_abs[i], self._limit[i]
            if seen is None and not any(self._nonfinite[i]):
                continue
            modules[name] = ActivationModule(self._classes[i], seen, limit,
                                             None if seen is None or limit is None else seen / limit,
                                             self._nonfinite[i][0], self._nonfinite[i][1])
        first = {k: None if v is None else FirstNonfinite.from_dict(v) for k, v in self._first.items()}
        return ActivationSummary(self.enabled, self.every, self.headroom, self._sampled, self.first_nonfinite_module,
                                 first["forward"], first["backward"], modules, self._error, culprit)

    def summary(self) -> dict[str, Any]:
        """Return a JSON-ready summary: per-module max abs seen, headroom ratio, first non-finite fwd/bwd."""
        return self.section().to_dict()

    # ---- internals ------------------------------------------------------------------------------------------
    def _label(self, i: int) -> str:
        return f"{self._names[i]} ({self._classes[i]})"

    def _report(self, code: str, i: int, severity: Severity, step: int, detail: str,
                where: str | None = None, fix: str | None = None) -> Finding | None:
        if (code, i) in self._reported:
            return None
        self._reported.add((code, i))
        self._findings.append(get_rule(code).finding(where or self._label(i), detail, step, severity=severity,
                                                     fix=fix))
        return self._findings[-1]

    def _forward_fix(self, i: int, written: bool, lines: list[str]) -> str | None:
        """Return the fix of module ``i``'s AMP601 (None: the rule's, the overflow fix). ``written``: its weights are
        already inf/NaN; where nothing trains them, no optimizer step wrote them, and ``lines`` are told so."""
        frozen = self._frozen_weights(i)
        if written and frozen:   # a cast or a checkpoint made them so
            if WEIGHTS_WRITTEN in lines:
                lines[lines.index(WEIGHTS_WRITTEN)] = WEIGHTS_FROZEN
            return frozen_weights_fix()
        if written:
            return nonfinite_weights_fix(self._weight_dtypes(i))
        if frozen and "float16" in self._weight_dtypes(i):   # a half model nothing trains: no autocast to leave
            return frozen_half_fix(self._names[self._starts[self._root_of[i]]])
        return None

    def _frozen_weights(self, i: int) -> bool:
        """Whether module ``i`` has weights of its own and none of them trains (``requires_grad`` off)."""
        own = list(self._require_root(self._root_of[i]).get_submodule(self._paths[i]).parameters(recurse=False))
        return bool(own) and not any(p.requires_grad for p in own)

    def _weight_dtypes(self, i: int) -> list[str]:
        """Return the dtypes of module ``i``'s own parameters, by name."""
        module = self._require_root(self._root_of[i]).get_submodule(self._paths[i])
        return [dtype_name(p.dtype) for p in module.parameters(recurse=False)]

    def _require_root(self, root: int) -> nn.Module:
        if (model := self._roots[root][0]()) is None:
            raise RuntimeError(f"the model {self._names[self._starts[root]]} watched by this ActivationMonitor no "
                               "longer exists")
        return model

    def _require_model(self) -> nn.Module:
        if (model := self._model()) is None:
            raise RuntimeError("the model watched by this ActivationMonitor no longer exists")
        return model

    def _remove_hooks(self) -> None:
        handles, self._handles, self._active = self._handles, [], False
        for handle in handles:
            handle.remove()

    def _fail(self, exc: BaseException) -> None:
        """Report an internal error once as AMP001 and switch off; the user's training goes on."""
        if self._broken:
            return
        self._broken, self._error = True, f"{type(exc).__name__}: {exc}"
        if self._record is not None:  # break rec.last -> tensor -> probe -> rec, and let go of the inputs
            self._record.closed, self._record.last, self._record.replay = True, None, {}
        self._record = None
        self._remove_hooks()
        self._findings.append(internal_error_finding(exc, "ActivationMonitor",
                                                     after="; the activation monitor is off for the rest of the run"))
