"""A framework callback's place in a job of several processes: one report for the job, as ``ampdoctor run`` gives.

Lightning (``strategy="ddp"``, ``"ddp_spawn"``) and the transformers Trainer (under torchrun) run the callback in
every process. Each rank diagnoses its own replica (pre-flight, watch, crash explanation); at the end it hands its
report to rank 0 through ``ampdoctor.runner.rank_reports.RankExchange``, the file hand-over the command line uses,
so rank 0 prints once and writes one JSON whose findings list the ranks that saw them. Files, not
torch.distributed: a rank that crashed never reaches a collective, and a collective only some ranks join hangs the
job. No rank ever waits on another in a collective of ours; rank 0 waits for files, with a deadline.

The ranks meet in a folder named from what the launcher gives every rank of one launch: torchrun's variables, or
only ``MASTER_ADDR``/``MASTER_PORT`` (Lightning sets those, and takes the rank from the process group), plus
``-callback{n}``, the n-th run of a callback in this process: ``ampdoctor run`` around the same script meets in its
own folder, and a second ``fit`` in the same processes does not read the first one's files. Without any of these
(a process group made by hand with an ``init_method`` URL) there is nowhere to meet: each rank writes its own JSON,
labelled with its rank (``report.rank1.json``), and only rank 0, or a rank that crashed, prints.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ampdoctor.core.ranks import RankInfo, from_environment, from_process_group, launch_job
from ampdoctor.core.report import Report
from ampdoctor.runner.rank_reports import RankExchange, label_rank, rank_path

__all__ = ["CallbackRanks"]

_RUNS = itertools.count()   # the callback runs of this process; every rank runs the same ones, in the same order


class CallbackRanks:
    """This rank's side of one callback run of a distributed job.

    Args:
        info: this process's rank.
        exchange: the hand-over to rank 0, started; None where the launch has no name to meet under.
    """

    def __init__(self, info: RankInfo, exchange: RankExchange | None) -> None:
        self.info, self.exchange = info, exchange
        self.rank = info.rank
        self.merged: Report | None = None   # rank 0: the job's report, once collected

    @classmethod
    def detect(cls) -> "CallbackRanks | None":
        """Return this process's side of the job, or ``None`` in a single process (the callback works as before).

        The process group first (Lightning sets no ``RANK``), then torchrun's variables; reading them is local.
        """
        info = from_process_group() or from_environment()
        if info is None:
            return None
        job = info.job or launch_job()
        if job is None:
            return cls(info, None)
        exchange = RankExchange(replace(info, job=f"{job}-callback{next(_RUNS)}"))
        exchange.start()   # rank 0: clear what a killed earlier launch left in the folder
        return cls(info, exchange)

    def log_dir(self, log_dir: str | None) -> str | None:
        """Return where this rank's flight recorder goes: a folder stays (the recorder names the file
        ``ampdoctor.rank{r}.jsonl``); a ``.jsonl`` file becomes ``name.rank{r}.jsonl``, so ranks never share one."""
        if log_dir is None or Path(log_dir).suffix != ".jsonl":
            return log_dir
        return f"{log_dir[:-len('.jsonl')]}.rank{self.rank}.jsonl"

    def json_path(self, json_path: str | None) -> str | None:
        """Return where this rank writes its JSON before the end (after pre-flight, after a crash): rank 0 the path
        asked for (the merged report replaces it at the end); no other rank, except where there is no exchange."""
        if json_path is None:
            return None
        if self.exchange is None:
            return rank_path(json_path, self.rank)
        return json_path if self.rank == 0 else None

    def end(self, own: Report, failed_at: float | None, json_path: str | None, show: bool,
            say: Callable[[Any], None], write: Callable[[str, str], None], watch_summary: Any = None) -> None:
        """Report the job: rank 0 collects, prints and writes the merged report; the other ranks hand theirs over,
        and a rank that crashed prints its own (labelled with its rank) where rank 0 could not report it.

        ``say`` prints a renderable or a line; ``write(path, text)`` writes a file; ``show`` is whether rank 0
        prints at all.
        """
        exit_code = int(own.exception is not None)
        explained = bool(own.extra.get("explained_by"))
        if self.exchange is None:
            labelled, path = label_rank(own, self.rank, json_path)
            if path:
                write(path, labelled.to_json())
            if (show and self.rank == 0) or exit_code:
                say(labelled)
            return
        exchange = self.exchange
        try:
            exchange.send(own, exit_code, explained, failed_at)
            if self.rank != 0:
                mine, lines = exchange.unreported(own, exit_code, explained)
                if mine is not None:
                    say(mine)
                    if json_path:   # rank 0 may never write it; if it still does, it writes the merge over it
                        write(json_path, mine.to_json())
                        say(f"ampdoctor: rank {self.rank}'s report written to {json_path}")
                for line in lines:   # the callback reports before the framework prints the traceback
                    say(f"ampdoctor: {line.replace('its traceback is above', 'its traceback follows')}")
                return
            self.merged = merged = exchange.collect(own, exit_code, explained, failed_at)
            if json_path:
                write(json_path, merged.to_json())
            if show:
                if watch_summary is not None and (own.extra.get("watch") or {}).get("steps"):
                    say(watch_summary)   # rank 0's own numbers; each rank's are in its own flight recorder
                shown = exchange.shown(merged)
                first = (merged.exception or {}).get("rank")
                if first not in (None, "0") and exchange.statuses.get(int(first), {}).get("printed"):
                    # its own rank printed that crash already (rank 0 was blocked on it): summary_lines names it
                    shown = replace(shown, exception=None)
                    if shown.findings or shown.missing_ranks or shown.changes:
                        say(shown)
                else:
                    say(shown)
                for line in exchange.summary_lines(merged, own):
                    say(f"ampdoctor: {line}")
            exchange.announce(merged)
        finally:
            exchange.finish()   # a SIGTERM that came while waiting is delivered now, as without ampdoctor


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole (a reader, or a crash mid-write, never sees half a file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)
