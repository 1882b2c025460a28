"""The ``--fix`` side of a run: pick the least invasive repair per model, apply it, re-apply after a downcast."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from ampdoctor.core.dtypes import LOW_PRECISION, dtype_name
from ampdoctor.core.findings import REPAIRED, Finding, Severity
from ampdoctor.core.report import Report
from ampdoctor.core.training import TrainingSetup, optimizer_tensors, owns_any
from ampdoctor.core.words import counted

_NORM_CHANGES = ("upcast frozen norm", "upcast norm buffer")
_SHOWN_CHANGES = 20


class RunRepairs:
    """Repair the models of a run: upcast under autocast, fp32 master weights without it.

    Args:
        report: where the changes are recorded.
        on_event: called with each human-readable line.
    """

    def __init__(self, report: Report, on_event: Callable[[str], None]) -> None:
        self.report = report
        self.on_event = on_event
        self._master: list[Any] = []
        self._trainable: dict[int, list[torch.Tensor]] = {}   # by model
        self._model_of: dict[int, nn.Module] = {}             # every submodule of a repaired model -> the model

    def knows(self, module: nn.Module) -> bool:
        """Return whether ``module`` is (part of) a model already looked at by `apply`."""
        return id(module) in self._model_of

    def apply(self, setup: TrainingSetup, parts: list[nn.Module], autocast: dict[int, torch.dtype | None]) -> None:
        """Repair every model of ``setup`` that trains low-precision parameters.

        Args:
            setup: the run's objects; its models are the outermost owners of what the optimizers train.
            parts: the modules seen running a forward (whole models, or the parts a training step calls).
            autocast: the autocast dtype each seen part ran under (None: no autocast).
        """
        snapshot, masters, changes = _Snapshot(setup), len(self._master), len(self.report.changes)
        try:
            self._apply(setup, parts, autocast)
        except Exception as exc:
            # All or nothing: undo every change, so a refused or failed fix leaves the run exactly as it was.
            for master in reversed(self._master[masters:]):
                master.detach()
            del self._master[masters:]
            snapshot.restore()
            del self.report.changes[changes:]
            self.on_event(f"ampdoctor --fix: rolled back, nothing changed ({type(exc).__name__}: {exc})")
            raise

    def _apply(self, setup: TrainingSetup, parts: list[nn.Module], autocast: dict[int, torch.dtype | None]) -> None:
        for model in setup.models:
            inside = {id(m) for m in model.modules()}
            dtypes = [autocast.get(id(part)) for part in parts if id(part) in inside]
            trainable = [p for p in model.parameters() if p.requires_grad]
            self._trainable[id(model)] = trainable
            self._model_of.update((i, model) for i in inside)
            low = [p for p in trainable if p.dtype in LOW_PRECISION]
            if not low:
                continue
            if self._refused(setup, model, low):
                self._trainable[id(model)] = []   # and not re-applied after a downcast either
                continue
            if any(d is not None for d in dtypes):
                self._upcast(setup, model)
            else:
                self._master_weights_for(setup, model)

    def _refused(self, setup: TrainingSetup, model: nn.Module, low: list[torch.Tensor]) -> bool:
        """Leave ``model`` alone, saying why, when DDP's reducer, FSDP or an engine owns its parameters' dtype.

        Neither repair works there: an upcast after ``DistributedDataParallel(model)`` breaks the reducer's
        per-dtype buckets, and MasterWeights' ``.data``/``.grad`` swaps fight them; FSDP and DeepSpeed/Megatron/apex
        keep their own copies. The fix belongs in the script, before the model is wrapped.
        """
        from ampdoctor.repairs._state import owner_refusal, upcast_refusal

        refusal = next((r for r in (upcast_refusal(setup.name_of(p), p) for p in low) if r is not None), None)
        refusal = refusal or owner_refusal(low, "--fix", [o for o in setup.optimizers if owns_any(o, model)])
        if refusal is None:
            return False
        text = str(refusal).rstrip(".")
        text = text if text.startswith("--fix refused") else f"--fix refused: {text}"
        message = f"{text}; {type(model).__name__} was left unchanged."
        refused = self.report.extra.setdefault("fix_refused", [])
        if message not in refused:   # said once, however often the run is looked at again
            refused.append(message)
            self.on_event(f"ampdoctor {message}")   # "ampdoctor --fix refused: ..."
        return True

    def repair(self, setup: TrainingSetup, parts: list[nn.Module], autocast: dict[int, torch.dtype | None],
               found: list[Finding], look: Callable[[], list[Finding]],
               on_error: Callable[[BaseException], None]) -> list[Finding]:
        """Repair ``setup`` (`apply`), then return ``found`` with what the repair resolved turned into info.

        Args:
            setup, parts, autocast: as for `apply`.
            found: the findings before the repair; ``look()`` finds them again after it.
            on_error: receives an exception of the repair, which `apply` rolled back: the findings stand.
        """
        before = len(self.report.changes)
        try:
            self.apply(setup, parts, autocast)   # all or nothing: it rolls back on error, and says so
        except Exception as exc:
            on_error(exc)
            return found
        if len(self.report.changes) == before:
            return found
        # What the fix resolved stays in the report, as info that says so: the code still has the bug.
        found, fixed, line = split_repaired(found, look())
        if line:
            self.report.extra.setdefault("fixed", []).extend(f.to_dict() for f in fixed)
            self.on_event(line)
        return found

    def reapply(self, setup: TrainingSetup, module: nn.Module, autocast: torch.dtype | None) -> None:
        """Upcast again before this forward if a validation or resume path cast the model back to half.

        (diffusers' validation does ``.to(float16)``): the backward then produces fp32 gradients again.
        """
        model = self._model_of.get(id(module))
        trainable = self._trainable.get(id(model)) if model is not None else None
        if autocast is None or not trainable or any(m.optimizer is not None for m in self._master_for(model)):
            return
        if any(p.dtype in LOW_PRECISION for p in trainable):
            self._upcast(setup, model)

    def detach(self) -> None:
        """Remove the master weights that were added (the model stays in half, holding the latest values)."""
        for master in reversed(self._master):
            master.detach()
        self._master, self._trainable, self._model_of = [], {}, {}

    def _upcast(self, setup: TrainingSetup, model: nn.Module) -> None:
        from ampdoctor.repairs.upcast import upcast_frozen_norms_, upcast_trainable_params_

        optimizers = [o for o in setup.optimizers if owns_any(o, model)]
        changes = upcast_trainable_params_(model, optimizer=optimizers[0] if optimizers else None)
        for opt in optimizers[1:]:  # already fp32 now: this migrates each further optimizer's state
            changes += upcast_trainable_params_(model, optimizer=opt)
        why = "upcast trainable parameters to float32 (forward runs under autocast)"
        # fp32 activations now reach frozen half norms, which CPU autocast runs as stored ("mixed dtype (CPU)")
        # and CUDA autocast does not upcast in every case (BatchNorm): their weights and buffers go to fp32 too
        norms = upcast_frozen_norms_(model) if changes else []
        if norms:
            why += f", and {len(norms)} weights and buffers of half norm layers next to them"
        # named as the findings name them: with several models, after the script's name for this one
        prefix = next((p for m, p in zip(setup.models, setup.prefixes) if m is model), "")
        self._record([replace(c, name=prefix + c.name) for c in changes + norms], why)

    def _master_weights_for(self, setup: TrainingSetup, model: nn.Module) -> None:
        from ampdoctor.repairs.master_weights import MasterWeights

        for opt in setup.optimizers:
            if owns_any(opt, model) and all(m.optimizer is not opt for m in self._master):
                master = MasterWeights(opt)
                self._master.append(master)
                self._record([f"{setup.name_of(p)}: fp32 master weight added, model copy stays {dtype_name(p)}"
                              for p in master.wrapped_params()],
                             "fp32 master weights for a half-precision model without autocast")

    def _master_for(self, module: nn.Module) -> list[Any]:
        return [m for m in self._master if owns_any(m.optimizer, module)]

    def _record(self, changes: list[Any], why: str) -> None:
        if not changes:
            return
        lines = [str(c) for c in changes]
        self.report.changes.extend(lines)
        self.on_event(f"ampdoctor --fix: {why}; {counted(len(lines), 'change')}")
        # the frozen norms upcast so that fp32 activations can reach them change no number a user trains: one line
        norms = [c for c in changes if getattr(c, "what", "") in _NORM_CHANGES]
        shown = [str(c) for c in changes if c not in norms]
        for line in shown[:_SHOWN_CHANGES]:
            self.on_event(f"  {line}")
        if len(shown) > _SHOWN_CHANGES:
            self.on_event(f"  and {len(shown) - _SHOWN_CHANGES} more (every change is in the JSON report written with "
                          "--json PATH)")
        if norms:
            after = ", ".join(dict.fromkeys(c.after.removeprefix("torch.") for c in norms))
            self.on_event(f"  and {counted(len(norms), 'norm tensor')} upcast to {after} (each one is in the JSON "
                          "report written with --json PATH)")


class _Snapshot:
    """The parameters' data and gradients and the optimizers' state, by reference, to undo a fix exactly.

    A fix replaces tensors (``p.data = p.data.float()``, ``state[k] = v.float()``) and never writes into them, so
    keeping the old objects is enough to put everything back bit for bit.
    """

    def __init__(self, setup: TrainingSetup) -> None:
        params = {id(p): p for m in setup.models for p in m.parameters()}
        params.update((id(p), p) for o in setup.optimizers for p in optimizer_tensors(o))
        self.params = [(p, p.data, p.grad) for p in params.values()]
        self.buffers = [(module, name, b) for m in setup.models for module in m.modules()
                        for name, b in module.named_buffers(recurse=False)]  # frozen norms' running stats
        self.states = [(o, p, dict(o.state[p]) if p in o.state else None)
                       for o in setup.optimizers for p in optimizer_tensors(o)]

    def restore(self) -> None:
        with torch.no_grad():
            for p, data, grad in self.params:
                p.grad = None   # a gradient must match its parameter's dtype at every moment
                p.data = data
                p.grad = grad
        for module, name, b in self.buffers:
            setattr(module, name, b)
        for optimizer, p, state in self.states:
            if state is None:
                optimizer.state.pop(p, None)
            else:
                optimizer.state[p] = state


def split_repaired(found: list[Finding], remaining: list[Finding]) -> tuple[list[Finding], list[Finding], str | None]:
    """Return ``found`` with what a fix resolved turned into info that says so, the resolved findings, and the line
    that announces them (None when nothing was resolved). The code still has the bug, so the finding stays.

    Args:
        found: the findings before the fix; remaining: the same rules' findings after it.

    Every entry point names the fix ``--fix`` and the code that still has the bug ``the script``
    (``session.run``: the same words, however the run was started).
    """
    left = {f.place for f in remaining}
    fixed = [f for f in found if f.place not in left]
    kept = [f for f in found if f.place in left] + [
        replace(f, severity=Severity.INFO, detail=f"{REPAIRED}{f.detail}") for f in fixed]
    if not fixed:
        return kept, fixed, None
    counts = Counter(f.code for f in fixed)   # findings, by code: not the same unit as changes
    return kept, fixed, "ampdoctor --fix resolved " + ", ".join(
        f"{code} ({n} {'place' if n == 1 else 'places'})" for code, n in counts.items())
