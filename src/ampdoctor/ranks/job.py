"""The end of a job, written once for ``ampdoctor run`` and the callbacks: who shows what, who writes the JSON.

In a single process the process reports itself. In a job of several processes with an exchange (``ranks.exchange``),
every rank hands its report to rank 0, which shows and writes the job's one report; a rank other than 0 shows its
own only when it failed and rank 0 could not report it. In a process group made by hand (no exchange: nothing names
the launch) each rank writes its own JSON, labelled with its rank, and only rank 0, or a rank that failed, shows.

What is shown goes to ``say``: a `ampdoctor.core.report.ReportView` (the entry point draws it) or a line of text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ampdoctor.core.report import Report, ReportView, fix_sentence, repaired_codes
from ampdoctor.core.views import Line
from ampdoctor.ranks.exchange import RankExchange
from ampdoctor.ranks.info import RankInfo
from ampdoctor.ranks.merge import label_rank

__all__ = ["JobEnd", "end_job"]


@dataclass
class JobEnd:
    """How this process ends a run.

    Attributes:
        exit_code: the script's exit status (non-zero: it failed).
        explained: whether the crash was explained by a rule.
        failed_at: when it failed (``time.time()``), to order the ranks' crashes.
        json_path: where the JSON report was asked for, if anywhere.
        show: whether this process prints (a framework's main process; rank 0's decision in a job).
        fix: whether a fix was asked for (``--fix``, however it was asked: every entry point names it so).
        traceback: where the script's traceback is: ``"above"`` (printed already, ``ampdoctor run``) or
            ``"follows"`` (a framework prints it after the callback).
    """

    exit_code: int
    explained: bool
    failed_at: float | None
    json_path: str | None = None
    show: bool = True
    fix: bool = False
    traceback: str = "above"


def end_job(own: Report, end: JobEnd, exchange: RankExchange | None, rank: RankInfo | None,
            say: Callable[[Any], None], write: Callable[[str, str], None]) -> Report:
    """Show and write the end of a run for this process; return the report it spoke for (the job's on rank 0).

    Args:
        own: this process's report.
        end: how it ended, and what was asked.
        exchange: the hand-over to rank 0, started; None in a single process or where the launch has no name.
        rank: this process's rank where it is in a process group of several, else None.
        say: shows a ``ReportView`` or a line.
        write: ``write(path, text)`` writes a file.
    """
    if exchange is not None:
        exchange.send(own, end.exit_code, end.explained, end.failed_at)
        if exchange.rank != 0:
            return _other_rank(own, end, exchange, say, write)
        report = exchange.collect(own, end.exit_code, end.explained, end.failed_at)
        json_path = end.json_path
    elif rank is not None and "ranks" not in own.extra:   # a group made by hand: each rank reports itself
        report, json_path = label_rank(own, rank.rank, end.json_path)
        end = replace(end, show=end.show and (rank.rank == 0 or bool(end.exit_code)))
    else:
        report, json_path = own, end.json_path
    if end.show:
        _show(report, own, end, exchange, rank, say)
    if json_path:
        write(json_path, report.to_json())
        if end.show:
            say(Line(f"ampdoctor: report written to {json_path}", whole=True))   # the path, to copy
    if exchange is not None:
        exchange.announce(report)
    return report


def _other_rank(own: Report, end: JobEnd, exchange: RankExchange, say: Callable[[Any], None],
                write: Callable[[str, str], None]) -> Report:
    """A rank other than 0: it speaks only for a failure rank 0 could not report."""
    mine, lines = exchange.unreported(own, end.exit_code, end.explained, end.traceback)
    if mine is not None:
        say(ReportView(mine, exception=end.traceback == "follows", watch=False))
        if end.json_path:   # rank 0 may never write it; if it still does, it writes the merge over it
            write(end.json_path, mine.to_json())
            say(Line(f"ampdoctor: rank {exchange.rank}'s report written to {end.json_path}", whole=True))
    for line in lines:
        say(f"ampdoctor: {line}")
    return mine or own


def _show(report: Report, own: Report, end: JobEnd, exchange: RankExchange | None, rank: RankInfo | None,
          say: Callable[[Any], None]) -> None:
    """Show the report this process speaks for, and the lines under it: after a crash its findings first, right
    under the traceback that they explain, then the watch's numbers; else the numbers, then what they mean."""
    numbers = own.watch is not None and own.watch.steps   # a run that crashed before its first step has none
    crashed = bool(own.exception) and not own.extra.get("terminated")
    if numbers and not crashed:
        say(ReportView(own, exception=False, watch=True, findings=False))   # this rank's numbers; the others' logs
    repaired = {f.get("code") for f in report.extra.get("fixed", []) if isinstance(f, dict)}
    left = [f for f in report.findings if not (f.severity.value == "info" and f.code in repaired)]
    own_rank = exchange.rank if exchange is not None else rank.rank if rank is not None else None
    mine_first = not report.exception or report.exception.get("rank") in (None, str(own_rank))
    # the traceback printed above ends with this process's own exception; another rank's is shown with its rank
    exception = not mine_first or end.traceback == "follows"
    if left or end.exit_code or report.exception or report.saw_nothing or report.missing_ranks or report.unwatched:
        say(ReportView(exchange.shown(report) if exchange else report, exception=exception, watch=False))
    elif report.changes:
        say(_repaired_line(report, end))
    elif report.ok:   # earned: something was trained and seen, and nothing at warning or error was found
        say(ReportView(report, exception=False, watch=False))
    if numbers and crashed:
        say(ReportView(own, exception=False, watch=True, findings=False))
    for line in exchange.summary_lines(report) if exchange is not None else []:
        say(f"ampdoctor: {line}")   # ranks not heard from, and which rank failed first
    _closing_lines(report, own, end, left, mine_first, say)


def _closing_lines(report: Report, own: Report, end: JobEnd, left: list[Any], mine_first: bool,
                   say: Callable[[Any], None]) -> None:
    """Say what --fix could not do, and that a crash no rule knows is not a mixed-precision one."""
    if end.fix and not report.changes and left and not report.extra.get("fix_refused"):   # nothing it could do
        codes = list(dict.fromkeys(f.code for f in left if f.severity.value != "info"))
        if codes:
            one = len(codes) == 1
            say(f"ampdoctor --fix changed nothing: {', '.join(codes)} {'has' if one else 'have'} no "
                f"automatic repair; {'its fix is' if one else 'their fixes are'} in the script (how to fix, above)")
    stopped = own.extra.get("terminated") or own.extra.get("not_started")   # the verdict says why
    if mine_first and end.exit_code and own.exception and not end.explained and not stopped:
        where = "above, unchanged" if end.traceback == "above" else "follows"
        say(f"ampdoctor: the script failed with {own.exception['type']}, which is not a known mixed-precision "
            f"failure; its traceback is {where}.")
        if own.exception.get("facts"):   # what the run held at the crash (explanations.facts)
            say(f"ampdoctor: at the crash: {'; '.join(map(str, own.exception['facts']))}.")


def _repaired_line(report: Report, end: JobEnd) -> str:
    """Say that a fix left no findings, and that the code still has what it repaired (``core.report.fix_sentence``,
    as the page's verdict says it), and where the JSON lists it."""
    where = ""
    if end.json_path:
        where = (f", and listed as info in {end.json_path}" if repaired_codes(report)
                 else f" (each change is in {end.json_path})")
    return f"ampdoctor: {fix_sentence(report)}{where}"
