"""The summary sections of the numerics audit and of the state check (``monitor.parts.numerics_audit``, ``.state``).

Registered here, with the record format, so that every process reads them typed: ``ampdoctor report`` and the HTML
page of a run whose parts this process never loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ampdoctor.core.records._values import integer, items, num, text
from ampdoctor.core.records.summary import Section, register_section

__all__ = ["AuditedOp", "AuditSection", "StateSection"]

@dataclass(frozen=True)
class AuditedOp:
    """One audited op with its error: ``ulps`` is ``max |out - ref| / max |ref|`` in units of its format's
    roundoff (rounding the result alone costs 0.5)."""

    op: str
    phase: str
    dtype: str
    module: str
    where: str
    ulps: float

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "phase": self.phase, "dtype": self.dtype, "module": self.module, "where": self.where,
                "ulps": self.ulps}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AuditedOp":
        return cls(text(data.get("op")) or "", text(data.get("phase")) or "", text(data.get("dtype")) or "",
                   text(data.get("module")) or "", text(data.get("where")) or "", num(data.get("ulps")) or 0.0)

    def describe(self) -> str:
        """Return the op in one line: ``aten.mm.default (forward, bfloat16) in fc at model.py:12: 0.82``."""
        where = f" at {self.where}" if self.where else ""
        module = f" in {self.module}" if self.module else ""
        return f"{self.op} ({self.phase}, {self.dtype}){module}{where}: {self.ulps:.2g}"


@dataclass(frozen=True)
class AuditSection(Section):
    """What the numerics audit re-ran: the audited steps, the ops compared, the worst ones and the per-module worst
    error (in roundoff units), the events it reported, and the ops left out (over its limit per step).

    >>> s = AuditSection((0,), 170, worst=(AuditedOp("aten.mm.default", "forward", "bfloat16", "fc", "m.py:3", 0.8),))
    >>> AuditSection.from_dict(s.to_dict()) == s
    True
    >>> s.shown()[:2]
    [('audited steps', '0'), ('ops re-run', '170')]
    """

    steps: tuple[int, ...] = ()
    ops: int = 0
    reference: str = "float32"
    worst: tuple[AuditedOp, ...] = ()
    modules: tuple[tuple[str, float], ...] = ()
    events: int = 0
    left_out: int = 0
    gemm_flops: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "ops": self.ops, "reference": self.reference,
                "worst": [op.to_dict() for op in self.worst], "modules": [list(m) for m in self.modules],
                "events": self.events, "left_out": self.left_out, "gemm_flops": self.gemm_flops}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AuditSection":
        return cls(tuple(s for s in (integer(v) for v in items(data.get("steps"))) if s is not None),
                   integer(data.get("ops")) or 0, text(data.get("reference")) or "float32",
                   tuple(AuditedOp.from_dict(o) for o in items(data.get("worst")) if isinstance(o, dict)),
                   tuple((str(m[0]), num(m[1]) or 0.0) for m in items(data.get("modules"))
                         if isinstance(m, list) and len(m) == 2),
                   integer(data.get("events")) or 0, integer(data.get("left_out")) or 0,
                   integer(data.get("gemm_flops")) or 0)

    def shown(self) -> list[tuple[str, str]]:
        out = [("audited steps", ", ".join(map(str, self.steps)) or "none"), ("ops re-run", str(self.ops)),
               ("findings", str(self.events))]
        if self.left_out:
            out.append(("ops not re-run (over the limit per step)", str(self.left_out)))
        return out

    def worst_rows(self, limit: int = 3) -> list[tuple[str, list[str]]]:
        """Return the table every view shows: the ops (and module outputs) farthest from fp32, worst first, each
        op at a line and module once, as ``(op, [source line, module, phase and format, error])``."""
        rows: dict[tuple[str, str, str], tuple[str, list[str]]] = {}
        for op in self.worst:
            key = (op.op, op.where, op.module)
            if key not in rows and len(rows) < limit:
                rows[key] = (op.op.removeprefix("aten."), [os.path.basename(op.where) or "-", op.module or "-",
                                                           f"{op.phase} {op.dtype}", f"{op.ulps:.3g}"])
        return list(rows.values())


@dataclass(frozen=True)
class StateSection(Section):
    """What the state check read after each sampled step: the tensors checked (buffers, optimizer state), the
    steps, and the first non-finite ones with the step they were first seen at."""

    tensors: int = 0
    checks: int = 0
    nonfinite: tuple[tuple[str, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "checks": self.checks, "nonfinite": [list(n) for n in self.nonfinite]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StateSection":
        return cls(integer(data.get("tensors")) or 0, integer(data.get("checks")) or 0,
                   tuple((str(n[0]), integer(n[1]) or 0) for n in items(data.get("nonfinite"))
                         if isinstance(n, list) and len(n) == 2))

    def shown(self) -> list[tuple[str, str]]:
        """Nothing while every tensor stayed finite (AMP707 says the rest)."""
        if not self.nonfinite:
            return []
        return [("tensors checked", str(self.tensors)), ("checks", str(self.checks)),
                ("non-finite", ", ".join(f"{name} (step {step})" for name, step in self.nonfinite[:3]))]


register_section("audit", AuditSection)
register_section("state", StateSection)
