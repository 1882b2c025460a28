"""A report: findings plus context, one JSON shape for `check()`, `ampdoctor run` and `ampdoctor report`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ampdoctor.core.catalog import with_fix_command
from ampdoctor.core.environment import Environment
from ampdoctor.core.findings import Finding, Severity
from ampdoctor.core.records import REPORT_SCHEMA, Extras, WatchSummary, report_fields, report_to_dict
from ampdoctor.core.strict_json import json_text
from ampdoctor.core.views import Drawn
from ampdoctor.core.words import counted, word_for

SCHEMA = REPORT_SCHEMA
NOTHING_OBSERVED = ("nothing was trained in a process ampdoctor could see: no model ran a forward pass with "
                    "gradients, and no optimizer or GradScaler was used, so nothing was diagnosed")


@dataclass(frozen=True)
class Crash:
    """The crash a report records (``Report.exception``), read through attributes: its exception's type and message,
    the traceback, the rank it happened on in a job, and the facts read at it (``explanations.facts``)."""

    data: Mapping[str, Any]

    @property
    def type(self) -> str:
        return str(self.data.get("type", ""))

    @property
    def message(self) -> str:
        return str(self.data.get("message", ""))

    @property
    def traceback(self) -> str:
        return str(self.data.get("traceback") or "")

    @property
    def rank(self) -> str | None:
        rank = self.data.get("rank")
        return None if rank in (None, "") else str(rank)

    @property
    def facts(self) -> list[str]:
        facts = self.data.get("facts")
        return [str(f) for f in facts] if isinstance(facts, list) else []

    @property
    def line(self) -> str:
        """``ValueError: Attempting to unscale FP16 gradients.``"""
        return f"{self.type}: {self.message}"


@dataclass
class Report(Drawn):
    """What ampdoctor found in one run or one check.

    Attributes:
        findings: the findings, in the order found.
        exception: ``{"type", "message", "traceback"}`` of a crash, if any.
        environment: see ``ampdoctor.core.environment.environment()``; read when first shown.
        changes: what a fix changed, as strings.
        extra: what the run adds, each key typed (``core.records.Extras``): the watch's summary, a job's ranks, ...
        observed: how many models, optimizers and GradScalers a run saw (``ampdoctor run``); None for a
            ``check()`` of given objects. A run that saw none of them has diagnosed nothing, so it is never ``ok``.
        exit_status: the script's non-zero exit status under ``ampdoctor run`` (``sys.exit(1)`` after a NaN loss,
            Ctrl-C's 130, a crash's 1), else None. A run that stopped so is never ``ok``: it is no all-clear.

    A distributed run's report (``ampdoctor.ranks.merge.merge_rank_reports``) also has ``extra["ranks"]``; a rank
    whose report never arrived is listed under ``missing`` there, and makes the report not ``ok``: it was not diagnosed.

    >>> r = Report([Finding("AMP101", Severity.ERROR, "fc.weight", "float16")])
    >>> r.to_dict()["findings"][0]["title"]
    'Trainable float16 parameters under an fp16 GradScaler'
    """

    findings: list[Finding] = field(default_factory=list)
    exception: dict[str, str] | None = None
    environment: Mapping[str, Any] = field(default_factory=Environment)
    changes: list[str] = field(default_factory=list)
    extra: Extras = field(default_factory=Extras)
    observed: dict[str, int] | None = None
    exit_status: int | None = None

    @property
    def crash(self) -> Crash | None:
        """The crash (``exception``) read through attributes, None without one."""
        return None if self.exception is None else Crash(self.exception)

    @property
    def watch(self) -> WatchSummary | None:
        """The watch's summary (``extra["watch"]``), None where no watch ran."""
        return self.extra.get("watch")

    @property
    def saw_nothing(self) -> bool:
        """True when a run observed no model, optimizer or GradScaler at all: nothing was diagnosed."""
        return self.observed is not None and not any(self.observed.values())

    @property
    def unwatched(self) -> list[dict[str, Any]]:
        """Return what trained where ampdoctor could not see it run (``extra["unwatched"]``): per optimizer that
        stepped, the tensors of models it never saw run a forward pass (`unwatched_sentence` says it)."""
        entries = self.extra.get("unwatched")
        return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []

    @property
    def missing_ranks(self) -> list[int]:
        """Return the ranks of a distributed run whose report never reached the merge (killed, hung, other node)."""
        ranks = self.extra.get("ranks")
        missing = ranks.get("missing") if isinstance(ranks, dict) else None
        return [r for r in missing if isinstance(r, int)] if isinstance(missing, list) else []

    @property
    def ok(self) -> bool:
        """True when there is no error or warning finding, no exception, and the run saw what it trained."""
        return (self.exception is None and not self.saw_nothing and not self.missing_ranks and not self.exit_status
                and not self.unwatched and not any(f.severity is not Severity.INFO for f in self.findings))

    def codes(self) -> list[str]:
        """Return the distinct finding codes, in order of first appearance."""
        return list(dict.fromkeys(f.code for f in self.findings))

    def add(self, finding: Finding) -> None:
        """Append ``finding`` unless the same rule at the same place (``Finding.place``), seen by the same ranks, is
        already reported: the first one wins (a crash's explanation does not repeat the pre-flight's finding)."""
        if all((f.place, f.ranks) != (finding.place, finding.ranks) for f in self.findings):
            command = self.extra.get("fix_command")
            self.findings.append(with_fix_command(finding, command) if command else finding)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON shape of the report (``ampdoctor.core.records.report_to_dict``)."""
        why = None
        if self.saw_nothing:
            why = NOTHING_OBSERVED
        elif self.missing_ranks:
            why = missing_ranks_sentence(self.missing_ranks)
        elif self.unwatched:
            why = unwatched_sentence(self.unwatched)
        elif self.exit_status and not self.exception:
            why = exit_sentence(self)
        return report_to_dict(self, why)

    def to_json(self, **kwargs: Any) -> str:
        """Return `to_dict` as strict JSON (``core.strict_json.json_text``: inf and NaN as ``"inf"``, ``"nan"``);
        ``kwargs`` are ``json.dumps``'s layout options, ``indent=2`` unless given."""
        return json_text(self.to_dict(), indent=kwargs.pop("indent", 2), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Report":
        """Rebuild a report from ``to_dict()`` output; raise ``ValueError`` on anything else."""
        return cls(**report_fields(data))



@dataclass(frozen=True)
class ReportView(Drawn):
    """Which parts of a report to show: what an entry point hands its console (drawn by ``ampdoctor.ui``).

    Attributes:
        report: the report.
        exception: its exception's line (False where the traceback was just printed: its last line is the same).
        watch: the watch's summary, when the watch saw steps.
        findings: the findings, the fixes and what ``--fix`` changed, or the verdict.
    """

    report: Report
    exception: bool = True
    watch: bool = False
    findings: bool = True


def rank_spans(ranks: list[int]) -> str:
    """Return sorted ranks as text, runs of three or more as a span.

    >>> rank_spans([0, 1, 2, 3, 6]), rank_spans([0, 1])
    ('0-3, 6', '0, 1')
    """
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in spans)


def missing_ranks_sentence(missing: list[int]) -> str:
    """Return why a distributed run's report is not ``ok``: the ranks that sent none."""
    names = ", ".join(map(str, missing))
    return (f"no report from {word_for(len(missing), 'rank')} {names}: not diagnosed (killed, still running, "
            "or on a node whose files rank 0 cannot read)")


def unwatched_sentence(entries: list[dict[str, Any]]) -> str:
    """Return why a run whose optimizers stepped tensors that ampdoctor never saw used in a forward pass is not
    ``ok``: per optimizer, how many of its tensors, in which models or held by no module, and whether the watch
    still read their gradients and updates (``followed``).

    >>> text = unwatched_sentence([{"optimizer": "optimizer[0] (AdamW)", "tensors": 1, "trained": 1, "models": [],
    ...                             "held": 0, "free": 1}])
    >>> text.startswith("not watched: optimizer[0] (AdamW) stepped 1 of its 1 trainable tensor unseen: 1 that no ")
    True
    """
    parts = []
    for e in entries:
        held, free = int(e.get("held") or 0), int(e.get("free") or 0)
        whose = []
        if held:
            models = ", ".join(str(m) for m in e.get("models") or []) or "a model"
            whose.append(f"{held} in {models}, whose forward pass ampdoctor never saw run (module hooks run when a "
                         "module is called, not for model.forward(x))")
        if free:
            whose.append(f"{free} that no nn.Module holds, used while no model ran a forward pass (the watch follows "
                         "models: hold the tensors in an nn.Module and call it)")
        read = ("the watch read their gradients and updates, but no check of a forward pass covers them"
                if e.get("followed") else "the watch could not follow them; only the pre-flight checks read them")
        parts.append(f"{e.get('optimizer', 'an optimizer')} stepped {e.get('tensors', held + free)} of its "
                     f"{counted(int(e.get('trained') or 0), 'trainable tensor')} unseen: {'; '.join(whose)}; {read}")
    return f"not watched: {'; '.join(parts)}: this is no all-clear"


def exit_sentence(report: Report) -> str:
    """Return why a run that exited with a non-zero status and no exception is not ``ok``."""
    watch = report.watch
    after = "" if watch is None else f" after {counted(watch.steps, 'optimizer step')}"
    if report.extra.get("terminated"):
        return (f"the run was stopped by {report.extra['terminated']}{after} (exit status {report.exit_status}): "
                "the report covers the steps until then; this is no all-clear")
    found = "" if report.findings else ", and ampdoctor found no mixed-precision cause for it"
    hint = "" if report.findings or (watch is not None and watch.looked_at_every_step) else \
        " (`--activations --every 1` looks at the activations of every step)"
    return f"the script exited with status {report.exit_status}{after}{found}: this is no all-clear{hint}"



@dataclass(frozen=True)
class Verdict:
    """The closing sentence of a report, as every view shows it (console, ``ampdoctor report``, the HTML page).

    ``kind`` is ``"ok"`` for an earned all-clear (what was verified, over how many steps) and ``"no all-clear"``
    where the run stopped, saw nothing, or could not measure part of what an all-clear needs."""

    kind: str
    text: str


def verdict(report: Report) -> Verdict | None:
    """Return the report's closing sentence, or None where its findings or its crash are the last word.

    >>> verdict(Report()).text
    'no mixed-precision problems found in the setup (pre-flight checks only; no training step was watched)'
    >>> verdict(Report(exit_status=3)).kind
    'no all-clear'
    """
    if report.extra.get("not_started"):
        return Verdict("no all-clear", f"the script did not start ({report.extra['not_started']}, above): nothing "
                                       "ran, so nothing was diagnosed")
    if report.extra.get("terminated"):   # the findings so far: a stopped run is no all-clear of the rest
        return Verdict("no all-clear", exit_sentence(report))
    repaired = set(repaired_codes(report))
    # what --fix repaired stays as info (the script still has it); it is no finding left to close with
    if any(f.severity is not Severity.INFO or f.code not in repaired for f in report.findings):
        return None
    if report.saw_nothing:
        return Verdict("no all-clear", f"{NOTHING_OBSERVED}. If the training runs in another process, run it under "
                                       "ampdoctor too; `ampdoctor run` follows Python child processes it starts.")
    if report.exit_status and not report.exception:
        return Verdict("no all-clear", exit_sentence(report))
    if report.exception or report.missing_ranks or report.unwatched:   # each view says these apart, findings or not
        return None
    earned, fixed = _earned(report), fix_sentence(report)
    return earned if fixed is None else Verdict(earned.kind, f"{fixed}; {earned.text}")


def repaired_codes(report: Report) -> list[str]:
    """Return the codes of the findings ``--fix`` repaired in this run (``extra["fixed"]``), sorted.

    >>> repaired_codes(Report(extra={"fixed": [{"code": "AMP104"}, {"code": "AMP101"}, {"code": "AMP101"}]}))
    ['AMP101', 'AMP104']
    """
    fixed = report.extra.get("fixed")
    return sorted({str(f["code"]) for f in fixed if isinstance(f, dict) and f.get("code")}) \
        if isinstance(fixed, list) else []


def fix_sentence(report: Report) -> str | None:
    """Return what ``--fix`` left of a report: no finding, and what it repaired still in the script (it changed the
    objects of this run, not the code); None where it changed nothing.

    >>> fix_sentence(Report(changes=["fc.weight: upcast torch.float16 -> torch.float32"],
    ...                     extra={"fixed": [{"code": "AMP101"}]}))
    'no findings left after 1 change by --fix; what it repaired (AMP101) is still in the script'
    """
    if not report.changes:
        return None
    changes = counted(len(report.changes), "change")
    codes = repaired_codes(report)
    if codes:
        return (f"no findings left after {changes} by --fix; what it repaired ({', '.join(codes)}) is still in "
                "the script")
    # no finding to resolve: it repaired before one arose (upcast again at the forward after a mid-run downcast)
    return f"no findings left after {changes} by --fix, made before a finding arose; the script still needs them"


def _earned(report: Report) -> Verdict:
    """Return the verdict of a run without findings: what was verified over how many steps, or, where some of it
    could not be measured, that this is no all-clear (``monitor.invariants.verified``)."""
    watch = report.watch
    checked = None if watch is None else watch.verified
    if watch is None or checked is None:
        return Verdict("ok", "no mixed-precision problems found in the setup (pre-flight checks only; no training "
                             "step was watched)")
    measured = "; ".join(checked.measured)
    missing = ", ".join(checked.not_measured)
    if not checked.measured:   # no step sampled, nothing trained: nothing was checked
        return Verdict("no all-clear", f"nothing was checked in {counted(watch.steps, 'step')} (not measured: "
                                       f"{missing}): this is no all-clear")
    if watch.stages:   # earlier stages of the run (a resume): their invariants held, or their findings would be listed
        measured += (f"; before that, {counted(len(watch.stages), 'earlier stage')} of "
                     f"{counted(sum(st.steps or 0 for st in watch.stages), 'step')}")
    if checked.ok and not missing:
        return Verdict("ok", f"no mixed-precision problems found in {counted(checked.steps, 'step')}: {measured}")
    return Verdict("no all-clear", f"no problem found in what was measured ({measured}); not measured: {missing}; "
                                   "so this is no all-clear")
