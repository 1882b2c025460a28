"""The end of a run, written once for every entry point: the log's report line, the job's end, SIGTERM's 143.

``ampdoctor run``, ``attach()`` (and ``AMPDOCTOR=...``), the notebook extension and the framework callbacks each
end their `Session` and then call `end_run`: this process's flight recorder gets the run's report as its last line,
and ``ranks.job.end_job`` shows the report (rank 0 for a job of several processes), writes the JSON and hands the
report over. What is said is the same whichever entry point ran the script; an entry point only tells where the
script's traceback is and whether it may print at all. A run stopped by SIGTERM is marked once, by `terminated`.
"""

from __future__ import annotations

from typing import Any, Callable

from ampdoctor.core.options import RunOptions
from ampdoctor.core.records import append_report
from ampdoctor.core.report import Report
from ampdoctor.ranks.exchange import RankExchange
from ampdoctor.ranks.info import RankInfo
from ampdoctor.ranks.job import JobEnd, end_job

__all__ = ["end_run", "terminated", "say_nothing", "INTERRUPT_STATUS", "SIGTERM_STATUS"]

SIGTERM_STATUS = 143   # 128 + SIGTERM, what the shell reports
INTERRUPT_STATUS = 130   # 128 + SIGINT: Ctrl-C


def terminated(report: Report, by: str = "SIGTERM", status: int = SIGTERM_STATUS) -> None:
    """Mark ``report`` as the report of a run that ``by`` stopped (a SIGTERM, Ctrl-C): it covers the steps until
    then."""
    report.exit_status = status
    report.extra["terminated"] = by


def end_run(report: Report, options: RunOptions, *, exit_code: int, failed_at: float | None,
            say: Callable[[Any], None], write: Callable[[str, str], None], explained: bool | None = None,
            traceback: str = "above", show: bool = True, exchange: RankExchange | None = None,
            rank: RankInfo | None = None) -> Report:
    """End a run for this process: its log's report line, then the job's end; return the report it spoke for (the
    job's on rank 0).

    Args:
        report: this process's report, the session finished.
        options: what the run was asked for (its JSON path, whether a fix was asked).
        exit_code: the script's exit status (non-zero: it failed).
        failed_at: when it failed (``time.time()``), to order the ranks' crashes.
        say: shows a ``ReportView`` or a line of ampdoctor's (``core.views.printer``); `say_nothing` where another
            run shows this process's report.
        write: ``write(path, text)`` writes a file.
        explained: whether a rule explained the crash (default: the report says so, ``extra["explained_by"]``).
        traceback: ``"above"`` (printed already) or ``"follows"`` (the framework prints it after the report).
        show: whether this process prints (a framework's main process).
        exchange, rank: the job's hand-over to rank 0, and this process's rank (``ranks.job.end_job``).
    """
    _append_to_log(report, say)
    if explained is None:
        explained = bool(report.extra.get("explained_by"))
    end = JobEnd(exit_code, explained, failed_at, options.json_path, show=show, fix=options.fix,
                 traceback=traceback)
    return end_job(report, end, exchange, rank, say, write)


def _append_to_log(report: Report, say: Callable[[Any], None]) -> None:
    """Append the report to this process's flight recorder, as its last line; say so where that fails."""
    log_path = report.watch.log_path if report.watch is not None else None
    if not log_path:
        return
    try:
        append_report(log_path, report.to_dict())
    except OSError as exc:
        say(f"ampdoctor: could not add the report to {log_path!r}: {exc.strerror}")


def say_nothing(item: Any) -> None:
    """Where another run shows the process's report: this end says nothing."""
