"""How many optimizer updates round away in low-precision (fp16/bf16) weights.

``w + Δ == w`` whenever ``|Δ|`` is below half an ulp of ``w``: with bf16 weights (8 significant bits) an update
smaller than ``|w| * 2**-9`` is lost. Optimizers with fp32 master weights never lose them; a pure-bf16 model
with a small learning rate loses most.

On a sampled step the monitor snapshots a fixed set of up to ``sample`` entries of each low-precision trainable
parameter in an optimizer step pre-hook (``register_step_pre_hook``), together with whether each entry's gradient
is non-zero, and compares them in the post-hook. An entry with a non-zero gradient whose stored value did not
change is counted as lost. That stands in for "the fp32 update was non-zero": it does not run the optimizer
twice, and misses only updates that weight decay alone would make. When a fused optimizer skips the step inside
its kernel (``optimizer.found_inf`` set by the GradScaler) the counts are multiplied by 0 on the device; a
for-loop or foreach optimizer is not called at all on a skipped step. Counts stay on the device until the owner's
sync.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.dtypes import HALF, dtype_name
from ampdoctor.core.findings import Finding
from ampdoctor.core.records import lost_updates_entry
from ampdoctor.monitor.grad_stats import sample_index

__all__ = ["LostUpdateMonitor", "LOST_FRACTION"]

LOST_FRACTION = 0.5  # AMP607 when most (> half) of the sampled updates of a parameter were lost


class LostUpdateMonitor:
    """Measure the fraction of updates lost to rounding in fp16/bf16 trainable parameters.

    Args:
        named_params: ``(name, parameter)`` pairs; only trainable fp16/bf16 ones are watched.
        sample: entries per parameter snapshotted on a sampled step.
        seed: seed of the private generator that picks the entries (the global RNG is never touched).
        on_error: called with an exception raised in a hook; the hook then does nothing more.

    >>> w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    >>> monitor = LostUpdateMonitor([("w", w)])
    >>> monitor.names
    ['w']
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], *, sample: int = 4096, seed: int = 0,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        picked = [(n, p) for n, p in named_params if p.requires_grad and p.dtype in HALF and p.numel()]
        self.names = [n for n, _ in picked]
        self._params: list[torch.Tensor] = [p for _, p in picked]
        self.dtypes = [dtype_name(p) for _, p in picked]
        self._index: list[torch.Tensor] = []
        for k, (_, p) in enumerate(picked):
            n = p.numel()
            idx = torch.arange(n) if n <= sample else sample_index(n, sample, seed * 1_000_003 + k)
            self._index.append(idx.to(p.device))
        self.on_error = on_error
        self.active = False
        self.broken = False  # set by an internal error: the hooks stay (they return at once) until detach()
        self._handles: list[Any] = []
        self._before: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._found_inf: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None  # [P, 2]: entries with a non-zero grad, of those unchanged
        # host-side totals per parameter
        self.with_grad = [0] * len(picked)
        self.lost = [0] * len(picked)
        self.steps = 0
        self._findings: list[Finding] = []

    def __bool__(self) -> bool:
        return bool(self._params)

    def attach(self, optimizer: torch.optim.Optimizer) -> "LostUpdateMonitor":
        """Register the step pre- and post-hooks on ``optimizer``; return ``self``. A no-op without fp16/bf16
        trainable parameters or when already attached."""
        if self._params and not self._handles:
            self._handles = [optimizer.register_step_pre_hook(self._pre_hook),
                             optimizer.register_step_post_hook(self._post_hook)]
        return self

    def detach(self) -> None:
        """Remove the hooks and drop every reference to parameters; totals stay.

        Never call it from inside an optimizer step hook: torch iterates over the hook dicts live during
        ``step()``, so removing a hook there raises in the user's ``step()``. Use :meth:`disable` there.
        """
        handles, self._handles = self._handles, []
        for handle in handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._params, self._index, self._before, self._counts, self._found_inf = [], [], None, None, None
        self.active = False

    def set_sampling(self, active: bool) -> None:
        """Snapshot around the next optimizer step(s) or not."""
        self.active = bool(active) and bool(self._handles) and not self.broken

    def disable(self) -> None:
        """Switch off for good without removing the hooks (safe inside an optimizer step hook): they return at
        once from now on; :meth:`detach` removes them."""
        self.broken = True
        self.active = False
        self._before = None
        self._counts = None

    # ---- hooks: device work only ----------------------------------------------------------------------------
    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.active or self.broken:
            return None
        try:
            with torch.no_grad():
                before = []
                for p, idx in zip(self._params, self._index):
                    values = p.detach().reshape(-1).index_select(0, idx)
                    g = p.grad
                    # only a half-precision weight loses updates to rounding; one that is fp32 now (a MasterWeights
                    # master between backward and step, an upcast model) keeps them
                    counted = g is not None and not g.is_sparse and p.dtype in HALF
                    moved = (g.reshape(-1).index_select(0, idx) != 0) if counted \
                        else torch.zeros_like(values, dtype=torch.bool)
                    before.append((values, moved))
                self._before = before
                found_inf = getattr(optimizer, "found_inf", None)  # set by GradScaler for fused optimizers
                self._found_inf = found_inf.detach().clone() if isinstance(found_inf, torch.Tensor) else None
        except Exception as exc:
            self._fail(exc)
        return None

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        before, self._before = self._before, None
        if before is None or not self.active or self.broken:
            return
        try:
            with torch.no_grad():
                rows = []
                for p, idx, (values, moved) in zip(self._params, self._index, before):
                    after = p.detach().reshape(-1).index_select(0, idx)
                    # a NaN/inf weight compares unequal to itself: it is broken, not updated, so it is not counted
                    moved = moved & torch.isfinite(values) & torch.isfinite(after)
                    unchanged = (after == values) & moved
                    rows.append(torch.stack([moved.sum(), unchanged.sum()]))
                counts = torch.stack(rows).to(torch.float32)
                if self._found_inf is not None:  # the fused kernel skipped this step: nothing was meant to change
                    counts = counts * (self._found_inf.to(counts.device) == 0)
                self._counts = counts if self._counts is None else self._counts + counts
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        # called inside an optimizer step hook: switch off, never remove hooks here (see detach)
        if self.broken:
            return
        self.disable()
        if self.on_error is not None:
            self.on_error(exc)

    # ---- the owner's sync -------------------------------------------------------------------------------------
    def pending(self) -> dict[str, torch.Tensor]:
        """Hand over the device counts gathered since the last call (``{}`` if none); the next sampled step starts
        new ones, also when this copy is read a step later (CUDA)."""
        counts, self._counts = self._counts, None
        return {} if counts is None else {"counts": counts}

    def consume(self, values: dict[str, list[float]], step: int) -> dict[str, Any] | None:
        """Take the host values of ``pending()``; return the step line's ``lost_updates`` entry (the counts of this
        sample: ``core.records.lost_updates_entry``), or None when nothing was counted."""
        flat = values.get("counts")
        if not flat or not any(flat[0::2]):
            return None   # no sampled entry had a gradient at the step (a step(closure) computes them after)
        self.steps += 1
        counts = []
        for k, name in enumerate(self.names):
            moved, unchanged = int(flat[2 * k]), int(flat[2 * k + 1])
            self.with_grad[k] += moved
            self.lost[k] += unchanged
            counts.append((name, moved, unchanged))
        self._check(step)
        return lost_updates_entry(counts)

    def fractions(self) -> dict[str, float]:
        """Return the lost fraction per watched parameter over every sampled step (parameters never updated
        are left out)."""
        return {n: lost / moved for n, lost, moved in zip(self.names, self.lost, self.with_grad) if moved}

    def _check(self, step: int) -> None:
        reported = {f.where for f in self._findings}
        for name, dtype, moved, lost in zip(self.names, self.dtypes, self.with_grad, self.lost):
            if moved and lost / moved > LOST_FRACTION and name not in reported and len(self._findings) < 5:
                self._findings.append(get_rule("AMP607").finding(
                    name,
                    f"{lost / moved:.0%} of sampled {dtype} entries with a non-zero gradient did not change in the "
                    f"optimizer step ({lost} of {moved} over {self.steps} sampled step(s)): each update was below "
                    f"half an ulp of its weight", step))

    def findings(self) -> list[Finding]:
        """Return AMP607 findings (at most 5 parameters)."""
        return list(self._findings)

    def summary(self) -> dict[str, Any]:
        """Return a JSON-ready summary: lost fraction per parameter and overall."""
        moved, lost = sum(self.with_grad), sum(self.lost)
        params = {n: {"dtype": d, "lost_fraction": lo / m}
                  for n, d, m, lo in zip(self.names, self.dtypes, self.with_grad, self.lost) if m}
        return {"params": params, "watched": len(self.names), "sampled_steps": self.steps,
                "lost_fraction": lost / moved if moved else None}
