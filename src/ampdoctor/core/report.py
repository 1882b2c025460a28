"""A report: findings plus context, one JSON shape for `check()`, `ampdoctor run` and `ampdoctor report`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from collections.abc import Iterable, Mapping
from typing import Any

from ampdoctor.core.environment import Environment
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.records import REPORT_SCHEMA, report_fields, report_to_dict

SCHEMA = REPORT_SCHEMA
NOTHING_OBSERVED = ("nothing was trained in a process ampdoctor could see: no model ran a forward pass with "
                    "gradients, and no optimizer or GradScaler was used, so nothing was diagnosed")


@dataclass
class Report:
    """What ampdoctor found in one run or one check.

    Attributes:
        findings: the findings, in the order found.
        exception: ``{"type", "message", "traceback"}`` of a crash, if any.
        environment: see ``ampdoctor.core.environment.environment()``; read when first shown.
        changes: what a fix changed, as strings.
        extra: other sections (watch summaries), JSON-ready.
        observed: how many models, optimizers and GradScalers a run saw (``ampdoctor run``); None for a
            ``check()`` of given objects. A run that saw none of them has diagnosed nothing, so it is never ``ok``.
        exit_status: the script's non-zero exit status under ``ampdoctor run`` (``sys.exit(1)`` after a NaN loss,
            Ctrl-C's 130, a crash's 1), else None. A run that stopped so is never ``ok``: it is no all-clear.

    A distributed run's report (`merge_rank_reports`) also has ``extra["ranks"]``; a rank whose report never
    arrived is listed under ``missing`` there, and makes the report not ``ok``: it was not diagnosed.

    >>> r = Report([Finding("AMP101", Severity.ERROR, "fc.weight", "float16")])
    >>> r.to_dict()["findings"][0]["title"]
    'Trainable float16 parameters under an fp16 GradScaler'
    """

    findings: list[Finding] = field(default_factory=list)
    exception: dict[str, str] | None = None
    environment: Mapping[str, Any] = field(default_factory=Environment)
    changes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    observed: dict[str, int] | None = None
    exit_status: int | None = None

    @property
    def saw_nothing(self) -> bool:
        """True when a run observed no model, optimizer or GradScaler at all: nothing was diagnosed."""
        return self.observed is not None and not any(self.observed.values())

    @property
    def missing_ranks(self) -> list[int]:
        """Return the ranks of a distributed run whose report never reached the merge (killed, hung, other node)."""
        missing = (self.extra.get("ranks") or {}).get("missing") if isinstance(self.extra.get("ranks"), dict) \
            else None
        return [r for r in missing if isinstance(r, int)] if isinstance(missing, list) else []

    @property
    def ok(self) -> bool:
        """True when there is no error or warning finding, no exception, and the run saw what it trained."""
        return (self.exception is None and not self.saw_nothing and not self.missing_ranks and not self.exit_status
                and not any(f.severity is not Severity.INFO for f in self.findings))

    def codes(self) -> list[str]:
        """Return the distinct finding codes, in order of first appearance."""
        return list(dict.fromkeys(f.code for f in self.findings))

    def add(self, finding: Finding) -> None:
        """Append ``finding`` unless the same code at the same place is already reported (first one wins)."""
        key = (finding.code, finding.where, finding.process, finding.ranks)
        if all((f.code, f.where, f.process, f.ranks) != key for f in self.findings):
            self.findings.append(finding)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON shape of the report (``ampdoctor.core.records.report_to_dict``)."""
        why = None
        if self.saw_nothing:
            why = NOTHING_OBSERVED
        elif self.missing_ranks:
            why = missing_ranks_sentence(self.missing_ranks)
        elif self.exit_status and not self.exception:
            why = exit_sentence(self)
        return report_to_dict(self, why)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 2), default=str, **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Report":
        """Rebuild a report from ``to_dict()`` output; raise ``ValueError`` on anything else."""
        return cls(**report_fields(data))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from ampdoctor.ui.console import render_report

        yield render_report(self)


def merge_rank_reports(reports: Mapping[int, Report], expected: Iterable[int] = (),
                       failed_at: Mapping[int, float] | None = None, notes: Iterable[str] = ()) -> Report:
    """Return one report of a distributed run from each rank's own report.

    A finding seen by several ranks (same code, severity, place, step, process and cause) becomes one finding
    listing them in ``ranks``. Where the ranks' details differ (their own numbers), the lowest rank's detail is
    kept, with one line per other rank (up to ``SHOWN_RANK_LINES``) giving the first line of its own detail that
    differs; every rank's whole detail stays in ``extra["ranks"]["details"]``. Findings at another place or step
    stay apart. The exception is the first crash (by ``failed_at``, seconds since the epoch; else the lowest rank
    that crashed), with its ``rank``; every crash is in ``extra["ranks"]["exceptions"]``. Ranks in ``expected``
    without a report are listed as ``missing``.

    >>> a = Report([Finding("AMP101", Severity.ERROR, "head", "float16")], observed={"models": 1})
    >>> b = Report([Finding("AMP101", Severity.ERROR, "head", "float16")], observed={"models": 1})
    >>> merged = merge_rank_reports({0: a, 1: b}, expected=[0, 1, 2])
    >>> [f.ranks for f in merged.findings], merged.observed, merged.missing_ranks
    ([(0, 1)], {'models': 2}, [2])
    """
    order = sorted(reports)
    merged = Report(environment=reports[order[0]].environment if order else {})
    where: dict[tuple[object, ...], int] = {}
    seen_by: list[list[tuple[int, str]]] = []   # per merged finding: (rank, its own detail)
    for rank in order:
        for f in reports[rank].findings:
            key = (f.code, f.severity, f.where, f.step, f.process, f.cause)
            if key in where and all(r != rank for r, _ in seen_by[where[key]]):
                seen_by[where[key]].append((rank, f.detail))
            else:   # new, or a second one of this rank (kept apart: it is not another rank's view of the first)
                where.setdefault(key, len(merged.findings))
                merged.findings.append(replace(f, ranks=f.ranks or (rank,)))
                seen_by.append([(rank, f.detail)])
    details = []
    for i, seen in enumerate(seen_by):
        if len(seen) == 1:
            continue
        first = merged.findings[i]
        ranks = tuple(sorted({r for r, _ in seen} | set(first.ranks or ())))
        detail = _rank_detail(seen)
        merged.findings[i] = replace(first, ranks=ranks, detail=detail)
        if detail != first.detail:   # numbers differ: keep each rank's own
            details += [{"code": first.code, "where": first.where, "step": first.step, "rank": r, "detail": d}
                        for r, d in seen]
    merged.exit_status = next((reports[r].exit_status for r in order if reports[r].exit_status), None)
    crashed = [r for r in order if reports[r].exception is not None]
    times = failed_at or {}
    if crashed:
        first = min(crashed, key=lambda r: (times.get(r, float("inf")), r))
        merged.exception = {**reports[first].exception, "rank": str(first)}
    if any(reports[r].observed is not None for r in order):
        merged.observed = {}
        for r in order:
            for kind, count in (reports[r].observed or {}).items():
                merged.observed[kind] = merged.observed.get(kind, 0) + count
    changes = [reports[r].changes for r in order]
    if changes and all(c == changes[0] for c in changes):
        merged.changes = list(changes[0])   # the same repair on every rank (DDP replicas): once
    else:
        merged.changes = [f"[rank {r}] {c}" for r in order for c in reports[r].changes]
    if order:
        merged.extra.update(reports[order[0]].extra)
    merged.extra["ranks"] = {
        "reported": order,
        "missing": sorted(set(expected) - set(order)),
        "exceptions": [{"rank": r, "type": reports[r].exception.get("type", ""),
                        "message": reports[r].exception.get("message", "")[:2000]} for r in crashed],
        **({"notes": list(notes)} if notes else {}),
        **({"details": details} if details else {}),
    }
    return merged


SHOWN_RANK_LINES = 3


def _rank_detail(seen: list[tuple[int, str]]) -> str:
    """Return the detail of a finding seen on several ranks: the lowest rank's, then for each other rank whose
    detail differs the first line that differs (``"rank N"`` in a line is not a difference)."""
    base_rank, base = seen[0]
    lines = base.splitlines()
    other = []
    for rank, detail in seen[1:]:
        if detail == base:
            continue
        own = detail.splitlines()
        same = [a.replace(f"rank {base_rank}", "rank _") == b.replace(f"rank {rank}", "rank _")
                for a, b in zip(lines, own)]
        differs = next((b for b, s in zip(own, same) if not s), None) or (own[len(lines)] if len(own) > len(
            lines) else None)
        if differs is not None:
            other.append((rank, differs))
    if not other:
        return base
    shown = [f"On rank {r}: {line.strip()}" for r, line in other[:SHOWN_RANK_LINES]]
    if len(other) > SHOWN_RANK_LINES:
        shown.append(f"{len(other) - SHOWN_RANK_LINES} more ranks saw other numbers; the JSON report has each "
                     "rank's detail (ranks.details).")
    return "\n".join([base, f"The numbers above are rank {base_rank}'s.", *shown])


def missing_ranks_sentence(missing: list[int]) -> str:
    """Return why a distributed run's report is not ``ok``: the ranks that sent none."""
    names = ", ".join(map(str, missing))
    return (f"no report from rank{'s' if len(missing) > 1 else ''} {names}: not diagnosed (killed, still running, "
            "or on a node whose files rank 0 cannot read)")


def exit_sentence(report: Report) -> str:
    """Return why a run that exited with a non-zero status and no exception is not ``ok``."""
    watch = report.extra.get("watch") or {}
    steps = watch.get("steps")
    after = f" after {steps} optimizer step{'' if steps == 1 else 's'}" if isinstance(steps, int) else ""
    found = "" if report.findings else ", and ampdoctor found no mixed-precision cause for it"
    looked = (watch.get("activations") or {}).get("sampled_steps")
    hint = "" if report.findings or (isinstance(steps, int) and isinstance(looked, int) and looked >= steps) else \
        " (`--activations --every 1` looks at the activations of every step)"
    return f"the script exited with status {report.exit_status}{after}{found}: this is no all-clear{hint}"

