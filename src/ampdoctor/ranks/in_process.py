"""The place in a job of several processes of a run attached inside the process: a framework callback, or
``ampdoctor.attach()`` in a worker function. One report for the job, as ``ampdoctor run`` gives.

Lightning (``strategy="ddp"``, ``"ddp_spawn"``) and the transformers Trainer (under torchrun) run the callback in
every process. Each rank diagnoses its own replica (pre-flight, watch, crash explanation); at the end it hands its
report to rank 0 through ``ampdoctor.ranks.exchange.RankExchange``, the hand-over the command line uses (the job's
c10d store under torchrun, else private files), so rank 0 prints once and writes one JSON whose findings list the
ranks that saw them (``ampdoctor.ranks.job.end_job``). No collective: a rank that crashed never reaches one, and a
collective only some ranks join hangs the job. Rank 0 waits for reports, with a deadline.

The ranks meet in a folder named from what the launcher gives every rank of one launch: torchrun's variables, or
only ``MASTER_ADDR``/``MASTER_PORT`` (Lightning sets those, and takes the rank from the process group), plus
``-callback{n}`` (``-attach{n}``), the n-th run of a callback (of ``attach()``) in this process: ``ampdoctor run``
around the same script meets in its own folder, and a second ``fit`` in the same processes does not read the first
one's files. Without any of these
(a process group made by hand with an ``init_method`` URL) there is nowhere to meet: each rank writes its own JSON,
labelled with its rank (``report.rank1.json``), and only rank 0, or a rank that crashed, prints.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ampdoctor.ranks.exchange import RankExchange
from ampdoctor.ranks.info import RankInfo, from_environment, from_process_group, launch_job
from ampdoctor.ranks.merge import rank_path

__all__ = ["InProcessRanks"]

# the runs of this process, by kind; every rank runs the same ones, in the same order
_RUNS: dict[str, itertools.count] = {}


class InProcessRanks:
    """This rank's side of one run of a distributed job attached inside the process (a callback, ``attach()``).

    Args:
        info: this process's rank.
        exchange: the hand-over to rank 0, started; None where the launch has no name to meet under.
    """

    def __init__(self, info: RankInfo, exchange: RankExchange | None) -> None:
        self.info, self.exchange = info, exchange
        self.rank = info.rank

    @classmethod
    def detect(cls, stopped: Callable[[], bool] = lambda: False, kind: str = "callback") -> "InProcessRanks | None":
        """Return this process's side of the job, or ``None`` in a single process (the run works as before).

        The process group first (Lightning sets no ``RANK``), then torchrun's variables; reading them is local.
        """
        info = from_process_group() or from_environment()
        if info is None:
            return None
        job = info.job or launch_job()
        if job is None:
            return cls(info, None)
        run = next(_RUNS.setdefault(kind, itertools.count()))
        exchange = RankExchange(replace(info, job=f"{job}-{kind}{run}"), stopped=stopped)
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
