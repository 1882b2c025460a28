"""The options of a run, given once and checked once, whichever entry point was asked.

``ampdoctor run --fix --every 10``, ``attach(fix=True, every=10)``, ``AMPDOCTOR='--fix --every 10'``, the notebook's
``%ampdoctor --fix`` and ``AmpDoctorCallback(fix=True, every=10)`` all become one frozen `RunOptions`, validated when
it is made: a bad value is refused before the first step, not at the end of a long run. Everything below the entry
points (the Doctor, the session, the child processes) takes the `RunOptions` as it is.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ampdoctor.core.usage import UsageError, check_outputs

__all__ = ["RunOptions", "check_every", "check_audit", "AUDIT_AUTO", "AUDIT_ALL", "AUDIT_OFF"]

# the numerics audit's policies (``monitor.parts.numerics_audit``)
AUDIT_AUTO, AUDIT_ALL, AUDIT_OFF = "auto", "all", "off"


def check_every(value: Any, name: str = "every") -> int:
    """Return ``value`` if it is a positive number of steps, else raise a usage error (a ``ValueError``) that says so
    with the value, spelled as the caller gave it (``every`` to a function, ``--every`` on the command line).

    >>> check_every(10)
    10
    >>> check_every(0, "--every")
    Traceback (most recent call last):
    ...
    ampdoctor.core.usage.UsageError: --every must be a positive number of steps, got 0; --every 1 looks at every step
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        one = f"{name} 1" if name.startswith("--") else f"{name}=1"
        raise UsageError(f"{name} must be a positive number of steps, got {value!r}; {one} looks at every step")
    return value


def check_audit(value: Any, name: str = "audit") -> str | tuple[int, ...]:
    """Return which steps the numerics audit re-runs: ``"auto"`` (the first sampled step and the step after the first
    anomaly), ``"all"`` (every sampled step), ``"off"``, or step numbers (a list, or ``"3,7"`` as ``--audit`` takes
    them), else raise a usage error that says so with the value.

    >>> check_audit("auto"), check_audit("0, 5"), check_audit([2]), check_audit(True), check_audit(False)
    ('auto', (0, 5), (2,), 'all', 'off')
    >>> check_audit("sometimes", "--audit")
    Traceback (most recent call last):
    ...
    ampdoctor.core.usage.UsageError: --audit takes all, auto, off or step numbers such as 0,5, got 'sometimes'
    """
    if value is True:
        return AUDIT_ALL
    if value is False or value is None:
        return AUDIT_OFF
    if isinstance(value, str) and value.strip().lower() in (AUDIT_AUTO, AUDIT_ALL, AUDIT_OFF):
        return value.strip().lower()
    parts = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else None
    try:
        steps = tuple(sorted({int(str(p).strip()) for p in parts})) if parts else ()
    except ValueError:
        steps = ()
    if not steps or any(s < 0 for s in steps) or any(isinstance(p, (bool, float)) for p in parts or ()):
        raise UsageError(f"{name} takes all, auto, off or step numbers such as 0,5, got {value!r}")
    return steps


@dataclass(frozen=True)
class RunOptions:
    """What a run was asked to do, the same for every entry point.

    Attributes:
        fix: repair trainable fp16/bf16 parameters before their first update (``--fix``).
        watch: attach the numerics watch (``--no-watch``: False).
        every: the watch's sampling interval, in optimizer steps (``--every``).
        log_dir: the watch's JSON-lines flight recorder folder, or a ``.jsonl`` file (``--log-dir``).
        activations: also watch every module's activations (``--activations``).
        json_path: where the JSON report is written at the end (``--json``).
        audit: which steps the numerics audit re-runs in fp32 (``--audit [STEPS]``, ``--no-audit``: `check_audit`).
        fix_command: how this run is asked for ``--fix`` where it was started, for the fixes to say
            (``ampdoctor run --fix finetune.py --lr 1e-4``, ``%ampdoctor --fix``); None: the catalog's words.

    Raises:
        ampdoctor.core.usage.UsageError: (a ``ValueError``) for an ``every`` that is not a positive int.
        TypeError: for a path that is neither a ``str`` nor an ``os.PathLike``.

    >>> RunOptions(fix=True, every=10).every
    10
    >>> RunOptions(log_dir=__import__("pathlib").Path("logs")).log_dir
    'logs'
    """

    fix: bool = False
    watch: bool = True
    every: int = 50
    log_dir: str | None = None
    activations: bool = False
    json_path: str | None = None
    fix_command: str | None = None
    audit: Any = AUDIT_OFF

    def __post_init__(self) -> None:
        check_every(self.every)
        object.__setattr__(self, "audit", check_audit(self.audit))
        for name in ("fix", "watch", "activations"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        for name in ("log_dir", "json_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a path (str or os.PathLike) or None, got {type(value).__name__}: "
                                f"{value!r:.80}")
            object.__setattr__(self, name, None if value is None else os.fspath(value))

    def check_outputs(self, json_option: str = "json_path=", log_dir_option: str = "log_dir=") -> None:
        """Refuse outputs that cannot be written now, before the run starts (``core.usage.check_outputs``); the
        options are named as the caller spells them (``--json``, ``json_path=``)."""
        check_outputs(self.json_path, self.log_dir, json_option, log_dir_option)

    def replace(self, **changes: Any) -> "RunOptions":
        """Return a copy with ``changes``, checked again.

        >>> RunOptions().replace(fix=True).fix
        True
        """
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Return the options as JSON-ready data (what a child process of ``ampdoctor run`` is given).

        >>> RunOptions.from_dict(RunOptions(every=3).to_dict()) == RunOptions(every=3)
        True
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunOptions":
        """Return the options of `to_dict` output; keys it does not know are refused (``TypeError``)."""
        data = dict(data)
        if isinstance(data.get("audit"), list):   # JSON has no tuples
            data["audit"] = tuple(data["audit"])
        return cls(**data)
