"""Which steps a watch looks at closely, on the defaults and after trouble.

The first steps are where most precision failures show (a cast model, a scale that collapses from the start), and a
short run must not end unsampled: steps ``0 .. DENSE_STEPS - 1`` are all sampled, then every ``every``-th. After the
first skipped step or non-finite gradient the next ``ESCALATE_STEPS`` steps are sampled too, and the watch arms an
``ActivationMonitor`` for one step to name the first module whose output is non-finite. A new episode of trouble
(after a clean sampled step) escalates again, up to ``MAX_ESCALATIONS`` times: the GradScaler's usual calibration
skip at step 0 must not use up the look at a later NaN batch. On a long run none of this costs anything after the
first steps.
"""

from __future__ import annotations

import math

from ampdoctor.core.records import Step

DENSE_STEPS = 10
ESCALATE_STEPS = 4
MAX_ESCALATIONS = 3


class Sampling:
    """The sampling schedule of one watch.

    >>> s = Sampling(every=50)
    >>> [step for step in range(120) if s.sampled(step)][-4:]
    [8, 9, 50, 100]
    >>> from ampdoctor.core.records import read_step
    >>> def line(step, skipped=()):
    ...     return read_step({"step": step, "scale": {"skipped": list(skipped)}})
    >>> s.escalate(line(60, [60]), step=60), s.sampled(61), s.sampled(65)
    (True, True, False)
    >>> s.escalate(line(61, [61]), step=61), s.escalate(line(62), step=62), s.escalate(line(63, [63]), step=63)
    (False, False, True)
    """

    def __init__(self, every: int, dense: int = DENSE_STEPS) -> None:
        self.every, self.dense = every, dense
        self.escalated_at: int | None = None   # the step whose record last started an episode of trouble
        self.escalations = 0
        self._troubled = False                 # whether the last sampled record showed trouble

    def sampled(self, step: int) -> bool:
        """Whether ``step`` is looked at closely: the first steps, every ``every``-th, and after trouble."""
        escalated = self.escalated_at is not None and step <= self.escalated_at + ESCALATE_STEPS
        return step < self.dense or step % self.every == 0 or escalated

    def escalate(self, record: Step, step: int) -> bool:
        """Return True when the step line ``record`` starts an episode of trouble: a skipped step or a non-finite
        gradient norm after a clean sampled step (at most ``MAX_ESCALATIONS`` times)."""
        skipped = record.scale is not None and record.scale.skipped
        norm = None if record.gradients is None else record.gradients.global_norm
        troubled = bool(skipped) or (norm is not None and not math.isfinite(norm))
        new_episode, self._troubled = troubled and not self._troubled, troubled
        if not new_episode or self.escalations >= MAX_ESCALATIONS:
            return False
        self.escalations += 1
        self.escalated_at = step
        return True
