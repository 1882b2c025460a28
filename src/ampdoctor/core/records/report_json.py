"""The JSON report of a run (``Report.to_dict()``, ``ampdoctor run --json``): its shape, written and read here, and
the typed sections a run adds to its findings (``Report.extra``: `Extras`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypedDict

from ampdoctor.core.catalog import get_rule
from ampdoctor.core.findings import Finding
from ampdoctor.core.records._values import integer as _int
from ampdoctor.core.records.summary import WatchSummary

__all__ = ["REPORT_SCHEMA", "Extras", "RanksExtra", "report_to_dict", "report_fields", "read_finding"]


class RanksExtra(TypedDict, total=False):
    """A job's report (``ranks.merge.merge_rank_reports``): the ranks whose report was merged and those whose never
    came, every rank's crash, what the merge noted, and each rank's own detail of a finding whose numbers differ."""

    reported: list[int]
    missing: list[int]
    exceptions: list[dict[str, Any]]
    notes: list[str]
    details: list[dict[str, Any]]


class Extras(TypedDict, total=False):
    """What a run adds to its findings (``Report.extra``), each key typed; the JSON report has them at its top level.

    Attributes:
        watch: the watch's summary (``core.records.summary.WatchSummary``).
        ranks: a job's report: its ranks (`RanksExtra`).
        explained_by: the codes that explained the crash ([]: no rule knew it).
        terminated: what stopped the run (``"SIGTERM"``, ``"Ctrl-C"``).
        not_started: the error that kept the script from starting (``"SyntaxError"``).
        fix_command: how this run asks for ``--fix``, as its fixes say it (``RunOptions.fix_command``).
        framework: the framework a callback ran under: name, version, precision, plugin, scaler.
        fixed: the findings ``--fix`` resolved (``Finding.to_dict``).
        fix_refused: why ``--fix`` left a model alone.
        clipping: the gradient clip's norms (``session.clip_norms``).
        child_processes: the child processes that reported; child_exceptions: their crashes.
        unwatched: per optimizer that stepped tensors no model seen running a forward pass holds, how many and
            whose (``core.report.unwatched_sentence``): the watch could not follow them, so the run is not ``ok``.
    """

    watch: WatchSummary
    ranks: RanksExtra
    explained_by: list[str]
    terminated: str
    not_started: str
    fix_command: str
    framework: dict[str, Any]
    fixed: list[dict[str, Any]]
    fix_refused: list[str]
    clipping: dict[str, Any]
    child_processes: list[str]
    child_exceptions: list[dict[str, Any]]
    unwatched: list[dict[str, Any]]

REPORT_SCHEMA = "ampdoctor.core.report/1"
_KNOWN_REPORT_KEYS = {"schema", "ok", "findings", "exception", "environment", "changes", "observed", "why_not_ok",
                      "exit_status"}


def report_to_dict(report: Any, why_not_ok: str | None) -> dict[str, Any]:
    """Return the JSON shape of a ``Report``: each finding with its rule's title and fix, and ``why_not_ok``.

    >>> from ampdoctor.core.report import Report
    >>> report_to_dict(Report(environment={}), None)["ok"]
    True
    """
    findings = []
    for f in report.findings:
        data = f.to_dict()
        try:
            rule = get_rule(f.code)
            data.update(title=rule.title, fix=f.fix or rule.fix)   # the fix that fits this finding, if it has one
        except KeyError:
            data.update(title="", fix="")
        findings.append(data)
    return {
        "schema": REPORT_SCHEMA, "ok": report.ok, "findings": findings, "exception": report.exception,
        "environment": dict(report.environment), "changes": report.changes,
        **({} if report.observed is None else {"observed": report.observed}),
        **({"exit_status": report.exit_status} if report.exit_status else {}),
        **({"why_not_ok": why_not_ok} if why_not_ok else {}),
        **{key: value.to_dict() if isinstance(value, WatchSummary) else value for key, value in report.extra.items()},
    }


def report_fields(data: Any) -> dict[str, Any]:
    """Return the ``Report`` fields of `report_to_dict` output; raise ``ValueError`` on anything else.

    >>> report_fields({"schema": REPORT_SCHEMA, "findings": [], "watch": {"steps": 3}})["extra"]["watch"].steps
    3
    """
    if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA:
        raise ValueError(f"not an ampdoctor report: expected schema {REPORT_SCHEMA!r}, got "
                         f"{(data.get('schema') if isinstance(data, dict) else type(data).__name__)!r:.80}")
    exception = _typed(data, "exception", dict, None)
    observed = _typed(data, "observed", dict, None)
    return {
        "findings": [read_finding(item) for item in _typed(data, "findings", list, [])],
        "exception": None if exception is None else {str(k): str(v) for k, v in exception.items()},
        "environment": _typed(data, "environment", dict, {}),
        "changes": [str(c) for c in _typed(data, "changes", list, [])],
        "extra": _extras(data),
        "observed": None if observed is None else {str(k): int(v) for k, v in observed.items() if _int(v) is not None},
        "exit_status": _typed(data, "exit_status", int, None),
    }


def _extras(data: dict[str, Any]) -> Extras:
    """Return the report's `Extras`: the watch's summary read back typed, the other keys as written."""
    extra: dict[str, Any] = {k: v for k, v in data.items() if k not in _KNOWN_REPORT_KEYS}
    if isinstance(extra.get("watch"), dict):
        extra["watch"] = WatchSummary.from_dict(extra["watch"])
    else:
        extra.pop("watch", None)
    return extra  # type: ignore[return-value]


def _typed(data: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ValueError(f"not an ampdoctor report: {key!r} should be a JSON {kind.__name__}, got "
                         f"{type(value).__name__}: {value!r:.80}")
    return value


def read_finding(data: Any) -> Finding:
    """``Finding.from_dict``, with a ``fix`` equal to its rule's read as the rule's (None): a report writes the
    rule's fix for every finding without one of its own (`report_to_dict`)."""
    finding = Finding.from_dict(data)
    if finding.fix is None:
        return finding
    try:
        own = finding.fix != get_rule(finding.code).fix
    except KeyError:
        own = True
    return finding if own else replace(finding, fix=None)
