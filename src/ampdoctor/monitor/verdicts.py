"""The watch's verdicts: the invariants of training health, and the arbitration between the parts' findings.

The rules name causes; the invariants name effects, so a run that fails for a reason no rule knows still gets a
finding, and the all-clear says what was verified. Each reads the watch's typed summary
(``core.records.WatchSummary``), whose numbers were measured on the device on sampled steps and read in the step's
one host copy:

* AMP612 progress: every step skipped; backward calls whose gradients were dropped before an optimizer step
  used them (``monitor.backward``: skipped iterations, zero_grad() between backward() and step()); sampled steps
  on which the optimizer moved none of the entries it had gradients for (``monitor.updates``). Up to
  ``CALIBRATION`` drops before the first step are a loss scaler calibrating.
* AMP613/614/615 the loss given to backward: inf/NaN on a step that was not skipped (saying so where every module
  output of that step's forward was seen finite), bit-identical over ``FROZEN`` sampled steps while the weights
  moved, or ending ``DIVERGED``x above the lowest of its first quarter.
* AMP610 inf/NaN losses, any step, where the run's log leaves them out (the watch was told what does:
  ``Watch.count_every_loss``, the transformers Trainer's ``logging_nan_inf_filter``).
* AMP616 weights inf/NaN at the end of a sampled step (on one the GradScaler reported as skipped: it was bypassed).
* AMP617 trainable parameters that had no gradient on any sampled step (an error when none had one): parameters of
  the models the run trains, not the optimizer's tensors of a model the script replaced (``Watch._trained``), which
  the all-clear says it could not verify.
* AMP618 a gradient clip that returned a norm of 0 over non-zero gradients: it was given no parameters.

Where two parts' findings say one thing twice, one gives way (`watch_findings`): AMP612 on every step skipped hides
AMP604, and an AMP601 that shows where the inf/NaN loss starts folds in AMP613.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.records import LossSummary, Verified, WatchSummary
from ampdoctor.core.words import counted, scale_text, word_for
from ampdoctor.explanations.fixes import nonfinite_loss_fix
from ampdoctor.monitor.activation_records import is_input

__all__ = ["invariant_findings", "verified", "watch_findings", "CALIBRATION", "FROZEN", "DIVERGED", "CODES"]

CODES = ("AMP610", "AMP612", "AMP613", "AMP614", "AMP615", "AMP616", "AMP617", "AMP618")   # the invariants'


CALIBRATION = 8      # drops before the first optimizer step that are a scaler calibrating (GradScaler: AMP604's)
DROPPED_SHARE = 0.10  # AMP612 warning above this share of backward calls dropped (and at least 3); error above half
FROZEN = 8           # AMP614: sampled steps with a bit-identical loss
DIVERGED = 10.0      # AMP615: the last loss this many times the lowest of the first quarter of the sampled ones
MIN_LOSSES = 8       # AMP615 needs this many finite sampled losses


def invariant_findings(summary: WatchSummary) -> list[Finding]:
    """Return the findings of every invariant that failed."""
    checks = (_all_skipped, _dropped, _unmoved, _weights, _loss_finite, _loss_hidden, _loss_frozen,
              _loss_diverging, _arrival, _clip)
    return [finding for check in checks for finding in check(summary)]


def _skipped_steps(s: WatchSummary) -> set[int]:
    return set(s.scale.skipped_steps) if s.scale is not None else set()


def _all_skipped(s: WatchSummary) -> Iterator[Finding]:
    scale = s.scale
    n = scale.steps if scale is not None else 0
    if n >= 3 and scale.skipped == n:
        # the lowest scale a step's backward ran with (the scale after the last step was never tried)
        lowest = min((v for _, v in scale.history), default=None)
        yield get_rule("AMP612").finding(
            scale.scaler, f"every one of the {n} optimizer steps was skipped (inf/NaN gradients at every loss scale "
            f"tried, down to {scale_text(lowest)}): no weight was updated" if lowest is not None else
            f"every one of the {n} optimizer steps was skipped: no weight was updated", n - 1,
            severity=Severity.ERROR)


def dropped_count(loss: LossSummary) -> int:
    """Return the dropped backward calls that count: up to ``CALIBRATION`` drops before the first step are a scaler
    calibrating, when they are at most a fifth of the calls."""
    early, calls = loss.dropped_early, loss.backwards
    calibration = min(early, CALIBRATION) if early <= 0.2 * calls else 0
    return max(0, loss.dropped - calibration)


def _dropped(s: WatchSummary) -> Iterator[Finding]:
    loss = s.loss
    if loss is None:
        return
    calls, dropped = loss.backwards, dropped_count(loss)
    if dropped < 3 or dropped <= DROPPED_SHARE * calls:
        return
    stepped = loss.steps_ended
    severity = Severity.ERROR if dropped > calls / 2 or not stepped else Severity.WARNING
    # the backward calls no step used: reset before the step that followed (zero_grad() between backward() and
    # step()), reset before any step (a skipped iteration), and the last ones, with no step after them
    zeroed = min(loss.zeroed_before_step, dropped)
    skipped, last = dropped - zeroed, loss.unstepped
    why = ("the skipped steps of the hand-written loss scaler: loss x its own scale" if loss.hand_scaled
           else "skipped iterations, e.g. of a hand-written loss scaler")
    kinds = [(n, what) for n, what in (
        (zeroed, "reset between backward() and the optimizer step that followed (zero_grad() before step()), "
                 "which never saw them"),
        (skipped, f"zeroed or replaced before a step used them ({why})")) if n]
    said = [f"{n} {what}" for n, what in kinds]
    if last:
        said.append("the last one had no step after it" if last == 1 else f"the last {last} had no step after them")
    body = kinds[0][1] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]   # one kind: all of them
    detail = (f"{dropped + last} of {calls} backward calls had gradients that no optimizer step used: {body}; the "
              f"optimizer stepped {counted(stepped, 'time')}")
    first, end = loss.first, loss.last
    if first and end:
        detail += (f", while the loss stayed at {end[1]:.4g}" if f"{first[1]:.4g}" == f"{end[1]:.4g}" else
                   f", while the loss went from {first[1]:.4g} to {end[1]:.4g}")
    yield get_rule("AMP612").finding("training loop", detail, None, severity=severity)


def _unmoved(s: WatchSummary) -> Iterator[Finding]:
    updates = s.updates
    if updates is None or len(updates.unmoved_steps) < 2:
        return
    unmoved, sampled = updates.unmoved_steps, updates.sampled_steps
    severity = Severity.ERROR if len(unmoved) == sampled else Severity.WARNING
    shown = ", ".join(map(str, unmoved[:6])) + (" …" if len(unmoved) > 6 else "")
    yield get_rule("AMP612").finding(
        "optimizer", f"on {len(unmoved)} of {sampled} sampled optimizer steps with a learning rate above 0 no "
        f"sampled weight entry with a non-zero gradient changed (steps {shown})", unmoved[0], severity=severity)


def _weights(s: WatchSummary) -> Iterator[Finding]:
    bad = dict(s.updates.nonfinite) if s.updates is not None else {}
    if not bad:
        return
    first = min(bad.values())
    names = sorted(bad, key=lambda n: bad[n])
    detail = (f"{counted(len(bad), 'parameter')} inf/NaN at the end of sampled step {first}"
              + (" and later" if len(set(bad.values())) > 1 else ""))
    if first in _skipped_steps(s):
        detail += (f"; the GradScaler reported step {first} as skipped, so the update bypassed it (an "
                   f"optimizer.step() outside scaler.step(), or weights written outside the optimizer)")
    yield get_rule("AMP616").finding(", ".join(names[:3]) + (" …" if len(names) > 3 else ""), detail, first)


def _loss_finite(s: WatchSummary) -> Iterator[Finding]:
    loss = s.loss
    bad = list(loss.nonfinite or ()) if loss is not None else []
    applied = [step for step in bad if step not in _skipped_steps(s)]
    last = loss is not None and loss.last_finite is False
    if not bad or (not last and not applied):
        return  # none, or each on a step the GradScaler skipped
    shown = ", ".join(map(str, bad[:6])) + (" …" if len(bad) > 6 else "")
    detail = (f"the loss given to backward was inf/NaN on {len(bad)} of {loss.sampled} sampled steps "
              f"(steps {shown})" + ("; the last sampled loss is one of them" if last else "")
              + (f"; {len(applied)} of those steps were not skipped, so their gradients reached the optimizer"
                 if applied else ""))
    finite = [step for step, module in loss.nonfinite_forward if module is None]
    if finite:   # the activation monitor saw those forwards: no module's output was inf/NaN
        seen = ", ".join(map(str, finite[:6])) + (" …" if len(finite) > 6 else "")
        detail += (f"; every module output of the model was finite on {word_for(len(finite), 'step')} {seen}, "
                   f"so there the inf/NaN come after the model, where the loss is computed from its output and "
                   f"whatever else it reads (a target, a frozen teacher's half-precision output)")
    yield get_rule("AMP613").finding("loss", detail, bad[0], severity=Severity.ERROR if last else Severity.WARNING,
                                     fix=nonfinite_loss_fix() if finite else None)


def _loss_hidden(s: WatchSummary) -> Iterator[Finding]:
    every = s.loss.every if s.loss is not None else None
    if every is None or not every.nonfinite or not every.hidden_by:
        return
    skipped = s.scale.skipped if s.scale is not None else 0
    also = f"; the GradScaler skipped {counted(skipped, 'step')}" if skipped else ""
    yield get_rule("AMP610").finding(every.hidden_by, (
        f"{every.nonfinite} of {every.losses} training losses were NaN/inf, the first at step {every.first}{also}. "
        "With logging_nan_inf_filter=True (the default) the Trainer adds the average of the earlier losses in their "
        "place, so the logged loss looks finite; set logging_nan_inf_filter=False to see them."), every.first)


def _loss_frozen(s: WatchSummary) -> Iterator[Finding]:
    identical = s.loss.identical if s.loss is not None else None
    if not identical or identical[0] < FROZEN:
        return
    n, first, last, value = identical
    unmoved = set(s.updates.unmoved_steps) if s.updates is not None else set()
    # the loss of step k is computed before its update: the weights changed within the run of identical losses only
    # if a step from first to last - 1 updated them; a GradScaler's skipped step did not (its calibration)
    skipped = _skipped_steps(s)
    if not any(k not in skipped for k in range(first, last)):
        return
    if s.updates is not None and s.updates.sampled_steps and not any(first <= u <= last for u in unmoved):
        yield get_rule("AMP614").finding(
            "loss", f"the loss was {value!r} on {n} consecutive sampled steps ({first} to {last}), bit for bit, "
            f"while the optimizer moved the weights", first)


def _loss_diverging(s: WatchSummary) -> Iterator[Finding]:
    loss = s.loss
    if loss is None:
        return
    head, last, peak = loss.head_min, loss.last, loss.peak
    finite = loss.sampled - len(loss.nonfinite or ())
    if head is None or last is None or finite < MIN_LOSSES or head <= 0:
        return
    if last[1] > DIVERGED * head and last[1] >= 0.5 * peak[1]:
        yield get_rule("AMP615").finding(
            "loss", f"the loss rose from {head:.4g} (the lowest of the first quarter of the sampled steps) to "
            f"{last[1]:.4g} at step {last[0]}, x{last[1] / head:.3g}", last[0])


def _arrival(s: WatchSummary) -> Iterator[Finding]:
    arrival = s.gradients.arrival
    without, params, reads = arrival.without, arrival.params, arrival.reads
    if not without or not reads:
        return
    names = ", ".join(without[:5]) + (f" and {len(without) - 5} more" if len(without) > 5 else "")
    # what was seen is the sampled steps: a tensor first used after them (a warm-up) is not said never to train
    looked = f"any of the {counted(reads, 'sampled step')}" if reads > 1 else "the one sampled step"
    if len(without) == params:
        yield get_rule("AMP617").finding(
            "model", f"none of the {params} trainable parameters had a gradient on {looked}: nothing trained on "
            f"{'them' if reads > 1 else 'it'}", None, severity=Severity.ERROR)
        return
    yield get_rule("AMP617").finding(
        names, f"{len(without)} of {params} trainable parameters had no gradient on {looked}, so "
        f"{'those steps' if reads > 1 else 'it'} did not update them", None)


def _clip(s: WatchSummary) -> Iterator[Finding]:
    grads = s.gradients
    nothing = grads.clipped_nothing
    if not nothing:
        return
    step, norm = nothing[0]
    yield get_rule("AMP618").finding(
        "clip_grad_norm_", f"the clip returned a total norm of 0 on {len(nothing)} of "
        f"{grads.arrival.reads or len(nothing)} sampled steps while the gradients' global norm was {norm:.3g} "
        f"(step {step}): it was given no parameters, so it clipped nothing", step)


def verified(summary: WatchSummary) -> Verified:
    """Return what the watch verified and what it could not measure (the all-clear says it; ``--json`` has it).

    ``ok`` is False where an invariant failed; ``measured`` names the checks that had data, ``not_measured`` the
    ones that had none.
    """
    scale, updates, loss, arrival = summary.scale, summary.updates, summary.loss, summary.gradients.arrival
    measured: list[str] = []
    missing: list[str] = []
    if scale is not None and scale.steps:   # its own count: steps it took no part in (a direct step) are not its
        measured.append(f"{scale.steps - scale.skipped} updated, {scale.skipped} skipped by the {scale.scaler}")
    if loss is not None and loss.dropped:
        measured.append(f"{loss.dropped} of {loss.backwards} backward calls skipped with no optimizer step")
    sampled = updates.sampled_steps if updates is not None else 0
    if sampled:
        moved = sampled - len(updates.unmoved_steps)
        measured.append(f"weights moved on {moved} of {sampled} sampled steps and stayed finite")
    else:
        missing.append("weight updates")
    if loss is not None and loss.sampled:
        frozen = loss.identical is not None and loss.identical[0] == loss.sampled > 1   # the same value on every one
        measured.append(f"loss finite and {'bit-identical' if frozen else 'changing'} on {loss.sampled} "
                        "sampled steps")
    else:
        missing.append("the loss (no backward seen)")
    outside = arrival.outside
    if arrival.reads and (arrival.params or not outside):
        measured.append(f"gradients reached {arrival.params - len(arrival.without)} of {arrival.params} trainable "
                        "parameters")
    elif not outside:
        missing.append("gradients")
    if outside:   # no AMP617 names them (they are no part of what trains), so nothing is verified of them either
        belong = "belongs" if outside == 1 else "belong"
        missing.append(f"{counted(outside, 'tensor')} the optimizer steps that {belong} to no model that ran (none had "
                       "a gradient)")
    unsampled = summary.steps - summary.sampled_steps
    if unsampled > 0:
        measured.append(f"{counted(unsampled, 'step')} not sampled")
    return Verified(not invariant_findings(summary), summary.steps, tuple(measured), tuple(missing))


def watch_findings(summary: WatchSummary, found: Sequence[Finding], invariants: Sequence[Finding]) -> list[Finding]:
    """Return a watch's findings: its parts' (``found``, in order) and the invariants', where one of two that say one
    thing gives way. Every step skipped is said once, as the error it is (AMP612 hides AMP604); an AMP601 that shows
    where the inf/NaN loss starts says it once (it folds in AMP613: `loss_explained`)."""
    out = list(found)
    scaler = summary.scale.scaler if summary.scale is not None else None
    if any(f.code == "AMP612" and f.where == scaler for f in invariants):
        out = [f for f in out if f.code != "AMP604"]
    first = [f for f in out if f.code == "AMP601"]
    if first and loss_explained(summary, first):
        invariants = [f for f in invariants if f.code != "AMP613"]
    return out + list(invariants)


def loss_explained(summary: WatchSummary, first: Sequence[Finding]) -> bool:
    """Whether AMP601 (``first``) explains the inf/NaN loss: on the first sampled step whose loss was inf/NaN a
    module's output already was (as the look at that forward, or AMP601's own step, shows), and every other step
    with an inf/NaN loss whose forward was looked at had a module's output inf/NaN too (not the input, not none)."""
    loss = summary.loss
    bad = list(loss.nonfinite or ()) if loss is not None else []
    looks = dict(loss.nonfinite_forward) if loss is not None else {}
    if not bad or any(module is None or is_input(module) for module in looks.values()):
        return False
    # a look at the first bad step that began inside its forward (the watch attached there) is not in `looks`;
    # an AMP601 of that step is the activation monitor's word that a module's output was inf/NaN on it
    return bad[0] in looks or any(f.step == bad[0] for f in first)
