"""What the optimizer step did to the weights: updates that round away, entries that moved, weights still finite.

``w + Δ == w`` whenever ``|Δ|`` is below half an ulp of ``w``: with bf16 weights (8 significant bits) an update
smaller than ``|w| * 2**-9`` is lost. Optimizers with fp32 master weights never lose them; a pure-bf16 model
with a small learning rate loses most.

On a sampled step the monitor snapshots a fixed set of up to ``sample`` entries of each trainable fp16/bf16
parameter, and up to ``MOVED_SAMPLE`` of a wider one (this rank's shard of a DTensor: every entry of a small one,
an evenly strided slice of a larger one, see ``_stride``) in an optimizer step pre-hook
(``register_step_pre_hook``), together with whether each entry's gradient is non-zero, and compares them in the
post-hook:

* **lost**: of the entries of an fp16/bf16 parameter with a non-zero gradient, those whose stored value did not
  change (AMP607). That stands in for "the fp32 update was non-zero": it does not run the optimizer twice, and
  misses only updates that weight decay alone would make. A parameter group whose learning rate is 0 (the first
  step of a warmup from 0) was meant not to move: its entries are not counted.
* **moved**: of the entries with a non-zero gradient in groups with lr > 0 (any dtype), those that changed: a step
  that moved none of them changed no weight (``monitor.verdicts``).
* **lost after the step**, for a parameter with an fp32 master (``ampdoctor.MasterWeights``, which ``--fix`` adds):
  the step works on the fp32 master and loses nothing itself, but the master can still lose the update before the
  next step, if something resets it to its rounded half copy (a write into the half copy that a master took over
  whole: open_clip's ``logit_scale.clamp_`` after each step once froze its bf16 temperature that way). When the
  next step is sampled too, its pre-hook compares: an entry the step moved that is back at its old value, which is
  also the half copy's rounding of what the step made, was lost (AMP607). A write that changed the half copy (a
  ``clamp_`` holding a weight at its bound) is the user's, and not counted.

When a fused optimizer skips the step inside its kernel (``optimizer.found_inf`` set by the GradScaler) the counts
are multiplied by 0 on the device; a for-loop or foreach optimizer is not called at all on a skipped step. At the
post-hook of a sampled step also says whether each parameter's sampled entries are still finite (no extra pass
over the weights: a full inf-norm of every parameter cost 16 ms a sampled step on bench/overhead.py's 10M-parameter
model, more than the gradient statistics). An inf/NaN outside the sampled entries reaches them, and the loss, in the
next step's forward and update.
Counts stay on the device until the owner's sync.

Cost. A large parameter's sampled entries are runs of 16 consecutive entries (one cache line of fp32), evenly
strided; the views of them are built once and kept while the parameter keeps its storage, so reading every
parameter's entries is two ``torch.cat`` whatever the number of parameters. Per-parameter ``index_select`` of
random entries cost about 16 us each, the two snapshots and the gradients' entries 4.3 ms a sampled step on
bench/overhead.py's 54-tensor model (more than the gradient statistics); these gathers now take 1.3 ms. Each
entry's outcome is one code (``_codes``), and one ``index_add_`` of ones counts the codes of every parameter (a
segment ``index_add_`` over ``[N, 3]`` cost 0.85 ms, a cumulative sum of three rows 0.2 ms).
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, Callable, Sequence

import torch

from ampdoctor._torch.distributed import local_numel
from ampdoctor.core.catalog import get_rule
from ampdoctor.core.dtypes import HALF, dtype_name
from ampdoctor.core.findings import Finding
from ampdoctor.core.records import LostSummary, UpdatesSummary, lost_updates_entry, updates_entry
from ampdoctor.core.words import counted
from ampdoctor.monitor.grad_stats import local_tensor
from ampdoctor.repairs.master_weights import compute_dtype

__all__ = ["UpdateMonitor", "LOST_FRACTION"]

LOST_FRACTION = 0.5  # AMP607 when most (> half) of the sampled updates of a parameter were lost
MOVED_SAMPLE = 256  # entries snapshotted of a parameter wider than fp16/bf16 (16 runs of 16): moved, still finite
_LOST_DENOMINATOR, _LOST, _EXPECTED, _MOVED = range(4)  # the columns of a step's device counts


class UpdateMonitor:
    """Measure what each sampled optimizer step did to the trainable parameters.

    Args:
        named_params: ``(name, parameter)`` pairs; trainable ones are watched (lost updates: fp16/bf16 ones).
        sample: entries per fp16/bf16 parameter snapshotted on a sampled step (of another, at most
            ``MOVED_SAMPLE``: its lost updates are not counted).
        seed: seed of the private generator that picks the entries (the global RNG is never touched).
        on_error: called with an exception raised in a hook; the hook then does nothing more.

    >>> w = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    >>> monitor = UpdateMonitor([("w", w)])
    >>> monitor.names
    ['w']
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], *, sample: int = 4096, seed: int = 0,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        picked = [(n, p) for n, p in named_params if p.requires_grad and local_numel(p)]
        self.names = [n for n, _ in picked]
        self._params: list[torch.Tensor] = [p for _, p in picked]
        # a parameter with an fp32 master (MasterWeights) by its half copy's dtype: fp32 between backward and step
        computes = [compute_dtype(p) or p.dtype for _, p in picked]
        self.dtypes = [dtype_name(d) for d in computes]
        # per parameter: (first entry, stride, blocks, width) of its flattened local tensor. Lost updates are counted
        # for fp16/bf16 weights, from ``sample`` entries; of a wider one only whether a step moved it and whether it
        # stayed finite, which MOVED_SAMPLE entries show as well (54 fp32 tensors of the bench model: 1.8 of its
        # 2.5 ms a sampled step went to gathering and comparing 99k entries)
        self._picks = [_stride(local_numel(p), p.shape[-1] if p.dim() else 1,
                               sample if d in HALF else min(sample, MOVED_SAMPLE), seed * 1_000_003 + k)
                       for k, ((_, p), d) in enumerate(zip(picked, computes))]
        self._views: list[tuple[Any, torch.Tensor] | None] = [None] * len(picked)  # (storage key, entries view)
        self.on_error = on_error
        self.active = False
        self.broken = False  # set by an internal error: the hooks stay (they return at once) until detach()
        self._handles: list[Any] = []
        self._before: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None  # per device group
        self._by_device: list[tuple[torch.device, list[int]]] | None = None
        self._bins: dict[torch.device, torch.Tensor] = {}  # int32 4 * the parameter (row in its group) of each entry
        self._masks: dict[Any, torch.Tensor] = {}
        self._found_inf: torch.Tensor | None = None
        # per device group, from the last step's post-hook when the next step's pre-hook is to check what became of
        # its fp32 masters' updates: (entries before, after, moved, half dtype of each member or None); or None
        self._after_step: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple] | None] | None = None
        self._counts: torch.Tensor | None = None  # [P, 4]: the _LOST_DENOMINATOR ... _MOVED columns
        self._finite: torch.Tensor | None = None  # [P]: 1 where the sampled entries were finite after the last step
        self._stepped = 0   # optimizer steps counted into _counts
        self.seconds = 0.0  # spent in the hooks of sampled steps
        # host-side totals per parameter
        self.with_grad = [0] * len(picked)
        self.lost = [0] * len(picked)
        self.masters = [False] * len(picked)   # counted after the step, on the fp32 master (see the module doc)
        self.steps = 0
        self.moved_steps: list[tuple[int, int, int]] = []   # (step, entries expected to move, of those moved)
        self.nonfinite: dict[str, int] = {}   # parameter -> the first sampled step it was inf/NaN after
        self._findings: list[Finding] = []

    def __bool__(self) -> bool:
        return bool(self._params)

    def attach(self, optimizer: torch.optim.Optimizer) -> "UpdateMonitor":
        """Register the step pre- and post-hooks on ``optimizer``; return ``self``. A no-op without trainable
        parameters or when already attached."""
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
        self._params, self._views, self._before, self._counts, self._found_inf = [], [], None, None, None
        self._after_step = None
        self._by_device, self._bins, self._masks = None, {}, {}
        self.active = False

    def set_sampling(self, active: bool) -> None:
        """Snapshot around the next optimizer step(s) or not."""
        self.active = bool(active) and bool(self._handles) and not self.broken

    def disable(self) -> None:
        """Switch off for good without removing the hooks (safe inside an optimizer step hook): they return at
        once from now on; :meth:`detach` removes them."""
        self.broken = True
        self.active = False
        self._before = self._after_step = None
        self._counts = self._finite = None

    # ---- hooks: device work only ----------------------------------------------------------------------------
    # The sampled entries of every parameter on a device are gathered into one vector (one cat of kept strided
    # views), and everything after that is a constant number of ops over it: each entry gets a code (finite now,
    # expected to move, unchanged), and one index_add_ counts the codes per parameter. Per-parameter comparisons
    # cost about 14 ops a parameter, 750 on the 54-tensor bench model, every sampled step.
    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.active or self.broken:
            self._after_step = None   # what became of an update is checked at the very next step only
            return None
        start = time.perf_counter()
        try:
            resting = _resting(optimizer)
            with torch.no_grad():
                before, after_step, self._after_step = [], self._after_step, None
                lost_after_step = []
                for g, (device, members) in enumerate(self._groups()):
                    views = [self._weights(k) for k in members]  # the post-hook reads the kept ones again
                    values = _joined([view for view, _ in views])
                    grads = _joined([self._sampled_grad(k) for k in members])
                    # only a half-precision weight loses updates to rounding; one that is fp32 now (a MasterWeights
                    # master between backward and step, an upcast model) keeps them in the step
                    meant = [id(self._params[k]) not in resting for k in members]
                    lossy = [m and self._params[k].dtype in HALF for k, m in zip(members, meant)]
                    # ... but a master can lose them after it: the next step's pre-hook looks (_lost_after_step)
                    halves = tuple(compute_dtype(self._params[k]) if m and self._params[k].dtype not in HALF else None
                                   for k, m in zip(members, meant))
                    before.append((views, values, grads != 0, self._flags(device, lossy, meant), halves))
                    if after_step is not None:   # the last step was sampled, and it had fp32 masters
                        lost_after_step.append(self._lost_after_step(device, members, after_step[g], values))
                self._before = before
                if after_step is not None:
                    self._add_counts(self._in_order(lost_after_step))
                found_inf = getattr(optimizer, "found_inf", None)  # set by GradScaler for fused optimizers
                self._found_inf = found_inf.detach().clone() if isinstance(found_inf, torch.Tensor) else None
        except Exception as exc:
            self._fail(exc)
        self.seconds += time.perf_counter() - start
        return None

    def _weights(self, k: int) -> tuple[torch.Tensor, bool]:
        """Return a view of parameter ``k``'s sampled entries, and whether it is a view kept across steps: kept while
        the parameter keeps its storage, dtype and size (``p.data = ...``, as ``MasterWeights`` does at each phase
        change, makes a new one); else it is a copy, to take again after the step."""
        p = self._params[k]
        # a DTensor, or a non-contiguous parameter (its flattened entries are a copy): every time. The storage's size
        # is in the key for storage freed and allocated again under the same parameter (FSDP's resharding)
        key = None if hasattr(p, "to_local") or not p.is_contiguous() else (
            p.data_ptr(), p.dtype, p.shape, p.untyped_storage().nbytes())
        kept = self._views[k]
        if key is None or kept is None or kept[0] != key:
            kept = self._views[k] = (key, _entries(local_tensor(p.detach()), self._picks[k]))
        return kept[1], key is not None

    def _sampled_grad(self, k: int) -> torch.Tensor:
        """Return parameter ``k``'s gradient at its sampled entries (zeros without a dense gradient)."""
        p, pick = self._params[k], self._picks[k]
        g = local_tensor(p.grad) if p.grad is not None else None
        if g is None or g.is_sparse:
            return torch.zeros(pick[2:] if _blocked(pick) else (pick[2] * pick[3],), dtype=p.dtype, device=p.device)
        return _entries(g, pick)

    def _groups(self) -> list[tuple[torch.device, list[int]]]:
        """Return the watched parameters by device (their sampled entries are gathered per device), built once."""
        if self._by_device is None:
            groups: dict[torch.device, list[int]] = {}
            for k, p in enumerate(self._params):
                groups.setdefault(local_tensor(p.detach()).device, []).append(k)
            # in the order of their concatenation (_joined): the one-dimensional views first
            self._by_device = [(d, sorted(m, key=lambda k: _blocked(self._picks[k]))) for d, m in groups.items()]
            # the first histogram bin (4 a parameter) of each entry of a device's concatenation
            self._bins = {d: torch.repeat_interleave(torch.arange(0, 4 * len(m), 4, dtype=torch.int32), torch.tensor(
                [self._picks[k][2] * self._picks[k][3] for k in m])).to(d) for d, m in self._by_device}
        return self._by_device

    def _flags(self, device: torch.device, lossy: list[bool], meant: list[bool]) -> torch.Tensor:
        """Return the ``[P, 4]`` float mask of the counted columns (lossy, lossy, meant, meant), one per flag set:
        built once per set, as a host-to-device copy of pageable memory would wait for the device."""
        key = (device, tuple(lossy), tuple(meant))
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = torch.tensor([[lo, lo, m, m] for lo, m in zip(lossy, meant)],
                                                   dtype=torch.float32).to(device)
        return mask

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        before, self._before = self._before, None
        if before is None or not self.active or self.broken:
            return
        start = time.perf_counter()
        try:
            with torch.no_grad():
                counts, finite, after_step = [], [], []
                for (device, members), (views, values, nonzero, flags, halves) in zip(self._groups(), before):
                    # an optimizer step changes no storage: a kept view reads the entries after it
                    after = _joined([view if kept else self._weights(k)[0] for k, (view, kept) in zip(members, views)])
                    # per parameter, how many entries have each code (see _codes): [P, 4]
                    code = _codes(values, after, nonzero)
                    after_step.append(self._keep_for_next_step(device, members, values, after, code, halves))
                    code.add_(self._bins[device])
                    hist = torch.zeros(len(members) * 4, dtype=torch.int64, device=device).index_add_(
                        0, code, self._ones(device, code.numel())).view(-1, 4).float()
                    moved, same = hist[:, 2], hist[:, 3]
                    expected = moved + same
                    counts.append(torch.stack([expected, same, expected, moved], 1) * flags)
                    finite.append((hist[:, 0] == 0).float())
                self._after_step = after_step if any(kept is not None for kept in after_step) else None
                counts_t, finite_t = self._in_order(counts), self._in_order(finite)
                if self._found_inf is not None:  # the fused kernel skipped this step: nothing was meant to change
                    counts_t = counts_t * (self._found_inf.to(counts_t.device) == 0)
                self._add_counts(counts_t)
                self._finite = finite_t   # after the last step: "finite now"
                self._stepped += 1
        except Exception as exc:
            self._fail(exc)
        self.seconds += time.perf_counter() - start

    def _keep_for_next_step(self, device: torch.device, members: list[int], values: torch.Tensor,
                            after: torch.Tensor, code: torch.Tensor, halves: tuple) -> tuple | None:
        """Return what the next step's pre-hook needs to see whether this step's updates of fp32 masters stayed:
        the entries before and after, those of the masters the step moved to a finite value, and the half dtypes;
        or None without a master among ``members``.

        The entries the step moved, not those with a gradient: a ``step(closure)`` (Lightning's) computes the
        gradients after the pre-hook, and MasterWeights has used them up (None) by the post-hook."""
        masters = tuple(d is not None for d in halves)
        if not any(masters):
            return None
        moved = (code >= 1).logical_and_(after != values).logical_and_(self._entry_mask(device, members, masters))
        return values, after, moved, halves

    def _add_counts(self, counts: torch.Tensor) -> None:
        self._counts = counts if self._counts is None else self._counts + counts

    def _lost_after_step(self, device: torch.device, members: list[int], kept: tuple | None,
                         now: torch.Tensor) -> torch.Tensor:
        """Return the ``[P, 4]`` counts (denominator, lost, 0, 0) of the fp32 masters' entries the last step moved,
        and of those undone by now: back at their value before that step, which is also what the half copy rounds
        the step's result to (a master reset from its half copy). A write that changed the half copy (a ``clamp_``
        holding the weight at its bound) leaves another value there: the user's, not counted."""
        if kept is None:
            return torch.zeros(len(members), 4, device=device)
        before, after, moved, halves = kept
        rounded = None
        for dtype in dict.fromkeys(d for d in halves if d is not None):   # one cast for one half dtype
            cast = after.to(dtype).float()
            rounded = cast if rounded is None else torch.where(
                self._entry_mask(device, members, tuple(d == dtype for d in halves)), cast, rounded)
        undone = (now == before).logical_and_(now == rounded).logical_and_(moved)
        for k, dtype in zip(members, halves):
            self.masters[k] = self.masters[k] or dtype is not None
        code = moved.to(torch.int32).add_(undone.to(torch.int32)).add_(self._bins[device])   # 1 kept, 2 undone
        hist = torch.zeros(len(members) * 4, dtype=torch.int64, device=device).index_add_(
            0, code, self._ones(device, code.numel())).view(-1, 4).float()
        zero = torch.zeros_like(hist[:, 0])
        return torch.stack([hist[:, 1] + hist[:, 2], hist[:, 2], zero, zero], 1)

    def _entry_mask(self, device: torch.device, members: list[int], flags: tuple[bool, ...]) -> torch.Tensor:
        """Return a bool mask over a device group's sampled entries: those of the members whose flag is set (made
        once per set of flags)."""
        key = (device, "entries", flags)
        mask = self._masks.get(key)
        if mask is None:
            sizes = torch.tensor([self._picks[k][2] * self._picks[k][3] for k in members])
            mask = self._masks[key] = torch.repeat_interleave(torch.tensor(key[2]), sizes).to(device)
        return mask

    def _ones(self, device: torch.device, n: int) -> torch.Tensor:
        """Return ``n`` int64 ones on ``device`` (what the histogram adds), made once."""
        ones = self._masks.get((device, "ones"))
        if ones is None or ones.numel() != n:
            ones = self._masks[(device, "ones")] = torch.ones(n, dtype=torch.int64, device=device)
        return ones

    def _in_order(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Return the per-device rows of ``parts`` as one tensor in the parameters' order (on the first device)."""
        order = [k for _, members in self._groups() for k in members]
        if len(parts) == 1 and order == sorted(order):
            return parts[0]
        device = parts[0].device
        key = (device, "order")
        inverse = self._masks.get(key)
        if inverse is None:
            inverse = self._masks[key] = torch.tensor(order).argsort().to(device)
        return torch.cat([part.to(device) for part in parts]).index_select(0, inverse)

    def _fail(self, exc: BaseException) -> None:
        # called inside an optimizer step hook: switch off, never remove hooks here (see detach)
        if self.broken:
            return
        self.disable()
        if self.on_error is not None:
            self.on_error(exc)

    # ---- the owner's sync -------------------------------------------------------------------------------------
    def pending(self) -> dict[str, torch.Tensor]:
        """Hand over the device counts gathered since the last call, and whether each watched parameter's sampled
        entries were finite after its last step; the next sampled step starts new counts."""
        counts, self._counts, stepped, self._stepped = self._counts, None, self._stepped, 0
        finite, self._finite = self._finite, None
        out: dict[str, torch.Tensor] = {}
        if counts is not None:
            out["counts"] = counts
            out["stepped"] = torch.tensor([float(stepped)])
        if finite is not None:
            out["finite"] = finite
        return out

    def consume(self, values: dict[str, list[float]], step: int,
                skipped: bool = False) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Take the host values of ``pending()``; return the step line's ``lost_updates`` entry (None when nothing
        was counted) and its ``updates`` entry (``core.records.updates_entry``). ``skipped``: a scaler reported
        this step as skipped."""
        flat, finite = values.get("counts"), values.get("finite")
        bad = [n for n, ok in zip(self.names, finite or []) if not ok]
        for name in bad:
            self.nonfinite.setdefault(name, step)
        lost_entry, stepped = None, int((values.get("stepped") or [0])[0])
        expected = moved = 0
        if flat:
            width = 4
            expected = int(sum(flat[_EXPECTED::width]))
            moved = int(sum(flat[_MOVED::width]))
            if expected:
                self.moved_steps.append((step, expected, moved))
            if any(flat[_LOST_DENOMINATOR::width]):
                self.steps += 1
                counts = []
                for k, name in enumerate(self.names):
                    with_grad, unchanged = int(flat[width * k + _LOST_DENOMINATOR]), int(flat[width * k + _LOST])
                    self.with_grad[k] += with_grad
                    self.lost[k] += unchanged
                    counts.append((name, with_grad, unchanged))
                self._check(step)
                lost_entry = lost_updates_entry(counts)
        entry = updates_entry(stepped=stepped, expected=expected, moved=moved, nonfinite=bad,
                              skipped=skipped) if (flat or bad) else None
        return lost_entry, entry

    def fractions(self) -> dict[str, float]:
        """Return the lost fraction per watched parameter over every sampled step (parameters never updated
        are left out)."""
        return {n: lost / moved for n, lost, moved in zip(self.names, self.lost, self.with_grad) if moved}

    def _check(self, step: int) -> None:
        reported = {f.where for f in self._findings}
        for k, (name, moved, lost) in enumerate(zip(self.names, self.with_grad, self.lost)):
            # every parameter the lost-updates table shows above LOST_FRACTION is named (the views group them)
            if moved and lost / moved > LOST_FRACTION and name not in reported:
                self._findings.append(get_rule("AMP607").finding(name, self._lost_detail(k), step))

    def _lost_detail(self, k: int) -> str:
        moved, lost, dtype = self.with_grad[k], self.lost[k], self.dtypes[k]
        if self.masters[k]:
            return (f"{lost / moved:.0%} of the sampled entries of its fp32 master weight that an optimizer step "
                    f"moved were back at their old value by the next step ({lost} of {moved} over "
                    f"{counted(self.steps, 'sampled step')} with a learning rate above 0): something reset the master "
                    f"to its rounded {dtype} copy after the step, and each update below half an ulp was lost")
        return (f"{lost / moved:.0%} of sampled {dtype} entries with a non-zero gradient did not change in the "
                f"optimizer step ({lost} of {moved} over {counted(self.steps, 'sampled step')} with a learning "
                f"rate above 0): each update was below half an ulp of its weight")

    def findings(self) -> list[Finding]:
        """Return AMP607 findings: one per parameter whose sampled updates were mostly lost."""
        return list(self._findings)

    def lost_section(self) -> LostSummary:
        """Return the lost updates' section of a watch summary: lost fraction per fp16/bf16 parameter and overall."""
        moved, lost = sum(self.with_grad), sum(self.lost)
        params = {n: (d, lo / m) for n, d, m, lo in zip(self.names, self.dtypes, self.with_grad, self.lost) if m}
        return LostSummary(params, sum(d in ("float16", "bfloat16") for d in self.dtypes), self.steps,
                           lost / moved if moved else None)

    def summary(self) -> dict[str, Any]:
        """Return a JSON-ready summary: lost fraction per fp16/bf16 parameter and overall (`lost_section`)."""
        return self.lost_section().to_dict()

    def updates_section(self) -> UpdatesSummary:
        """Return what the sampled steps did to the weights (``monitor.verdicts`` reads it)."""
        unmoved = tuple(s for s, expected, moved in self.moved_steps if expected and not moved)
        expected = sum(e for _, e, _ in self.moved_steps)
        return UpdatesSummary(len(self.names), len(self.moved_steps), unmoved,
                              sum(m for _, _, m in self.moved_steps) / expected if expected else None,
                              dict(self.nonfinite))


BLOCK = 16  # consecutive entries per sampled block: one 64-byte cache line of fp32 weights


def _stride(n: int, row: int, sample: int, seed: int) -> tuple[int, int, int, int]:
    """Return ``(first, stride, blocks, width)``: the sampled entries of a flattened ``n``-entry tensor are
    ``blocks`` runs of ``width`` consecutive entries, ``stride`` apart from the ``first``. All of them (one run)
    when ``n <= sample``; else ``sample // BLOCK`` runs of ``BLOCK`` from a seeded random start, with the stride
    coprime with the length of the last dimension ``row``, so that the runs start in every column of a matrix and
    not in a few. Runs of a cache line read 16 times less memory than as many single entries."""
    if n <= sample or sample < 2 * BLOCK:
        return (0, 1, 1, n) if n <= sample else (0, -(-n // sample), sample, 1)
    blocks = sample // BLOCK
    stride = max(1, (n - BLOCK) // (blocks - 1))  # the last run ends inside the tensor
    while stride > 1 and math.gcd(stride, row) != 1:
        stride -= 1
    first = random.Random(seed).randrange(max(1, n - (blocks - 1) * stride - BLOCK + 1))
    return first, stride, blocks, BLOCK


def _entries(t: torch.Tensor, pick: tuple[int, int, int, int]) -> torch.Tensor:
    """Return the entries ``pick`` names of ``t`` flattened, as a ``[blocks, width]`` view of it when ``t`` is
    contiguous (else of a flattened copy): one ``as_strided`` of its storage (a reshape and a slice were two ops a
    tensor, on every sampled step for the gradients)."""
    first, stride, blocks, width = pick
    if not t.is_contiguous():
        t = t.reshape(-1)  # a copy
    if blocks == 1:
        size, strides = (width,), (1,)
    elif width == 1:
        size, strides = (blocks,), (stride,)
    else:
        size, strides = (blocks, width), (stride, 1)
    return t.as_strided(size, strides, t.storage_offset() + first)


def _blocked(pick: tuple[int, int, int, int]) -> bool:
    """Whether ``_entries`` gives a ``[blocks, width]`` view for ``pick`` (else a one-dimensional one)."""
    return pick[2] > 1 and pick[3] > 1


def _codes(before: torch.Tensor, after: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """Return per sampled entry an int32 code, each implying the ones below it: 1 finite after the step, 2 also
    finite before and with a non-zero gradient (expected to move), 3 also unchanged (its update was lost); else 0.

    A NaN/inf weight compares unequal to itself: it is broken, not updated, so it is not expected to move. The
    difference is exactly 0 only for equal values (IEEE subtraction keeps subnormals; float32 holds every fp16 and
    bf16 value and their differences), and inf or NaN when either value is.
    """
    diff = after.float() - before.float() if after.dtype.itemsize < 4 else after - before
    code = torch.isfinite(after).to(torch.int32)
    code.add_(torch.isfinite(diff).logical_and_(nonzero))
    return code.add_((diff == 0).logical_and_(nonzero))


def _joined(views: list[torch.Tensor]) -> torch.Tensor:
    """Return a copy of the entries of ``views`` (the one-dimensional ones first, see ``_groups``) as one vector:
    two ``torch.cat`` at most, whatever the number of parameters."""
    flat = [v for v in views if v.dim() == 1]
    runs = [v for v in views if v.dim() == 2]
    parts = ([torch.cat(flat)] if flat else []) + ([torch.cat(runs).view(-1)] if runs else [])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _resting(optimizer: Any) -> set[int]:
    """Return the ids of the parameters in groups whose learning rate is 0 now (a plain number; a tensor lr is
    not read, as that would sync)."""
    out: set[int] = set()
    for group in getattr(optimizer, "param_groups", ()):
        lr = group.get("lr")
        if isinstance(lr, (int, float)) and lr == 0:
            out.update(id(p) for p in group["params"])
    return out
