"""Merge reports into one: a job's ranks (findings seen by several ranks once, AMP411 between them), a parent and
its child processes, a notebook's stages (`merge_reports`, the one merge they share).

Pure and local: nothing here starts a collective. The reports come from the hand-over (``ranks.exchange``), from
per-rank flight recorders (``ampdoctor report`` on a folder), from the child processes' folder
(``ranks.children``) or from a notebook's earlier doctors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding
from ampdoctor.core.report import Report
from ampdoctor.core.words import word_for

__all__ = ["merge_reports", "merge_rank_reports", "rank_disagreements", "disagreements", "label_rank", "rank_path",
           "with_parent", "summed_observed", "SHOWN_RANK_LINES"]


def merge_reports(reports: Sequence[Report], main: int = -1) -> Report:
    """Return one report of several parts of one run: a notebook's stages, a parent and what its child processes
    found, a job's ranks and the parent that launched them. Each finding once, in order (``Report.add``: the first
    one at a place wins); every change; the counts of what was observed summed (`summed_observed`); the exception,
    exit status, environment and extras of ``reports[main]`` (the notebook's current stage, the parent).

    >>> from ampdoctor.core.findings import Severity
    >>> first = Report([Finding("AMP103", Severity.WARNING, "head", "x")], observed={"models": 1}, changes=["a"])
    >>> later = Report([Finding("AMP103", Severity.WARNING, "head", "x")], observed={"models": 1}, changes=["b"])
    >>> merged = merge_reports([first, later])
    >>> merged.codes(), merged.observed, merged.changes
    (['AMP103'], {'models': 2}, ['a', 'b'])
    """
    keep = reports[main]
    merged = Report(exception=keep.exception, environment=keep.environment, extra=dict(keep.extra),
                    changes=[c for r in reports for c in r.changes], exit_status=keep.exit_status)
    for report in reports:
        for finding in report.findings:
            merged.add(finding)
    merged.observed = summed_observed(reports)
    return merged


def summed_observed(reports: Iterable[Report]) -> dict[str, int] | None:
    """Return how many models, optimizers and GradScalers the reports saw together; None when none counted.

    >>> summed_observed([Report(observed={"models": 1}), Report(), Report(observed={"models": 2, "scalers": 1})])
    {'models': 3, 'scalers': 1}
    """
    counted = [r.observed for r in reports if r.observed is not None]
    if not counted:
        return None
    observed: dict[str, int] = {}
    for counts in counted:
        for kind, count in counts.items():
            observed[kind] = observed.get(kind, 0) + count
    return observed


def merge_rank_reports(reports: Mapping[int, Report], expected: Iterable[int] = (),
                       failed_at: Mapping[int, float] | None = None, notes: Iterable[str] = ()) -> Report:
    """Return one report of a distributed run from each rank's own report.

    A finding seen by several ranks (the same ``Finding.key``: rule, place, process and step) becomes one finding
    listing them in ``ranks``. Where the ranks' details differ (their own numbers), the lowest rank's detail is
    kept, with one line per other rank (up to ``SHOWN_RANK_LINES``) giving the first line of its own detail that
    differs; every rank's whole detail stays in ``extra["ranks"]["details"]``. Findings at another place or step
    stay apart. The exception is the first crash (by ``failed_at``, seconds since the epoch; else the lowest rank
    that crashed), with its ``rank``; every crash is in ``extra["ranks"]["exceptions"]``. Ranks in ``expected``
    without a report are listed as ``missing``.

    >>> from ampdoctor.core.findings import Severity
    >>> a = Report([Finding("AMP101", Severity.ERROR, "head", "float16")], observed={"models": 1})
    >>> b = Report([Finding("AMP101", Severity.ERROR, "head", "float16")], observed={"models": 1})
    >>> merged = merge_rank_reports({0: a, 1: b}, expected=[0, 1, 2])
    >>> [f.ranks for f in merged.findings], merged.observed, merged.missing_ranks
    ([(0, 1)], {'models': 2}, [2])
    """
    order = sorted(reports)
    merged = Report(environment=reports[order[0]].environment if order else {})
    merged.findings, seen_by = _findings_by_key(reports, order)
    details = _join_ranks(merged.findings, seen_by)
    merged.exit_status = next((reports[r].exit_status for r in order if reports[r].exit_status), None)
    crashed = [r for r in order if reports[r].exception is not None]
    if crashed:
        times = failed_at or {}
        first = min(crashed, key=lambda r: (times.get(r, float("inf")), r))
        merged.exception = {**reports[first].exception, "rank": str(first)}
    merged.observed = summed_observed(reports[r] for r in order)
    merged.changes = _merged_changes(reports, order)
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


def _findings_by_key(reports: Mapping[int, Report],
                     order: list[int]) -> tuple[list[Finding], list[list[tuple[int, str]]]]:
    """Return one finding per ``Finding.key`` (each labelled with its first rank) and, for each, the ranks that saw
    it with their own detail."""
    findings: list[Finding] = []
    where: dict[tuple[object, ...], int] = {}
    seen_by: list[list[tuple[int, str]]] = []   # per merged finding: (rank, its own detail)
    for rank in order:
        for f in reports[rank].findings:
            key = f.key
            if key in where and all(r != rank for r, _ in seen_by[where[key]]):
                seen_by[where[key]].append((rank, f.detail))
            else:   # new, or a second one of this rank (kept apart: it is not another rank's view of the first)
                where.setdefault(key, len(findings))
                findings.append(replace(f, ranks=f.ranks or (rank,)))
                seen_by.append([(rank, f.detail)])
    return findings, seen_by


def _join_ranks(findings: list[Finding], seen_by: list[list[tuple[int, str]]]) -> list[dict[str, Any]]:
    """Give each finding seen by several ranks all their ranks and one detail, in place; return each rank's own
    detail of the findings whose numbers differ between ranks."""
    details = []
    for i, seen in enumerate(seen_by):
        if len(seen) == 1:
            continue
        first = findings[i]
        ranks = tuple(sorted({r for r, _ in seen} | set(first.ranks or ())))
        detail = _rank_detail(seen)
        findings[i] = replace(first, ranks=ranks, detail=detail)
        if detail != first.detail:   # numbers differ: keep each rank's own
            details += [{"code": first.code, "where": first.where, "step": first.step, "rank": r, "detail": d}
                        for r, d in seen]
    return details


def _merged_changes(reports: Mapping[int, Report], order: list[int]) -> list[str]:
    """Return what the ranks' fixes changed: once when every rank made the same repair, else each labelled."""
    changes = [reports[r].changes for r in order]
    if changes and all(c == changes[0] for c in changes):
        return list(changes[0])   # the same repair on every rank (DDP replicas): once
    return [f"[rank {r}] {c}" for r in order for c in reports[r].changes]


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


def rank_disagreements(per_rank: Mapping[int, Mapping[str, Any]]) -> list[Finding]:
    """Compare the ranks' skip decisions and loss scales, step by step, after the run (AMP411).

    Pure and local: it issues no collective. The caller gathers, from each rank's report, what that rank's
    loss-scale monitor recorded (``ampdoctor.monitor.loss_scale.ScaleMonitor``):

    * ``steps``: how many optimizer steps it saw;
    * ``skipped_steps``: the indices of the steps its GradScaler skipped;
    * ``scale_history``: ``(step, scale)`` whenever the scale it used changed.

    Only the steps every rank recorded are compared (a rank that crashed early is compared up to its last step).

    >>> same = {"steps": 3, "skipped_steps": [0], "scale_history": [(0, 65536.0), (1, 32768.0)]}
    >>> rank_disagreements({0: same, 1: same})
    []
    >>> other = {"steps": 3, "skipped_steps": [], "scale_history": [(0, 65536.0)]}
    >>> [f.code for f in rank_disagreements({0: same, 1: other})]
    ['AMP411']
    """
    if len(per_rank) < 2:
        return []
    common = min(int(r.get("steps", 0)) for r in per_rank.values())
    skipped = {rank: {int(s) for s in r.get("skipped_steps", ()) if int(s) < common} for rank, r in per_rank.items()}
    histories = {rank: sorted((int(s), float(v)) for s, v in r.get("scale_history", ()))
                 for rank, r in per_rank.items()}
    differ = sorted(set().union(*skipped.values()) - set.intersection(*skipped.values()))
    said: list[str] = []
    at: list[int] = []
    if differ:
        first = differ[0]
        skip = sorted(rank for rank, steps in skipped.items() if first in steps)
        took = sorted(rank for rank in skipped if rank not in skip)
        at.append(first)
        said.append(f"at optimizer step {first} {word_for(len(skip), 'rank')} {_ranks(skip)} skipped the step while "
                     f"{word_for(len(took), 'rank')} {_ranks(took)} "
                    f"applied it; {len(differ)} of the {common} steps compared {word_for(len(differ), 'was', 'were')} "
                    f"skipped on some ranks only")
    changes = sorted({s for h in histories.values() for s, _ in h if s < common})
    for step in changes:
        scales = {rank: _scale_at(h, step) for rank, h in histories.items()}
        if len(set(scales.values())) > 1:
            at.append(step)
            shown = ", ".join(f"rank {rank} {'?' if v is None else f'{v:g}'}" for rank, v in sorted(scales.items()))
            said.append(f"from step {step} the loss scales differ: {shown}")
            break
    if not said:
        return []
    return [Finding("AMP411", get_rule("AMP411").severity, f"{len(per_rank)} ranks",
                    "; ".join(said) + ". Each rank decided from its own gradients: its GradScaler does not all-reduce "
                    "found_inf (sharded gradients under a plain GradScaler, AMP211), so the replicas or shards were "
                    "updated on some ranks only", min(at))]


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _scale_at(history: list[tuple[int, float]], step: int) -> float | None:
    """Return the scale in force at ``step`` from ``(step, scale)`` change points (None before the first)."""
    scale = None
    for at, value in history:
        if at > step:
            break
        scale = value
    return scale


def label_rank(report: Report, rank: int, json_path: str | None) -> tuple[Report, str | None]:
    """Return ``report`` with its findings labelled ``rank``, and where that rank writes the JSON asked for.

    For a process group made by hand (no launcher's variables, so no folder to meet in): each rank reports itself.
    """
    return merge_rank_reports({rank: report}, expected=[rank]), rank_path(json_path, rank) if json_path else None


def rank_path(path: str, rank: int) -> str:
    """Return where rank ``rank`` writes the JSON report asked for as ``path`` when it reports on its own.

    >>> rank_path("out/report.json", 0), rank_path("out/report.json", 2), rank_path("report", 1)
    ('out/report.json', 'out/report.rank2.json', 'report.rank1')
    """
    if rank == 0:
        return path
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.rank{rank}.{suffix}" if dot and stem and os.sep not in suffix else f"{path}.rank{rank}"


def disagreements(reports: dict[int, Report]) -> list[Any]:
    """Return AMP411 when the ranks' watches recorded different skipped steps or loss scales (see
    `rank_disagreements`); nothing when fewer than two ranks watched the scale."""
    per_rank = {}
    for rank, report in reports.items():
        scale = report.watch.scale if report.watch is not None else None
        if scale is not None:
            per_rank[rank] = {"steps": scale.steps, "skipped_steps": list(scale.skipped_steps),
                              "scale_history": list(scale.history)}
    return rank_disagreements(per_rank) if len(per_rank) > 1 else []


def with_parent(ranks: Report, parent: Report) -> Report:
    """Return the ranks' merged report with what the parent, no rank itself, saw and did added to it: its findings
    first, its exception and environment, the ranks' extras over its own (`merge_reports`)."""
    merged = merge_reports([parent, ranks], main=0)
    merged.extra.update(ranks.extra)
    merged.exit_status = ranks.exit_status
    return merged
