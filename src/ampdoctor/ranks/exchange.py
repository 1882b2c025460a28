"""Hand each rank's report to rank 0, so a job of several processes prints one report and writes one JSON.

Why not torch.distributed collectives: when the script ends its process group is often destroyed already; a rank
that crashed never reaches a collective; and a collective that one rank starts and another never joins hangs the
whole job, the worst harm ampdoctor could do. The reports go through a `ranks.mailbox.Mailbox` instead: torchrun's
own c10d store (every node reaches it, nothing to configure), else a private folder named from what the launcher
gives all ranks of one launch and no other (``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, the restart
count), in the temporary directory or in ``AMPDOCTOR_RANK_DIR``. No rank ever waits on another in a collective;
rank 0 waits for reports, with a deadline.

1. Every rank, when it starts, leaves ``started{r}`` (its pid and host); rank 0 also clears what an earlier, killed
   launch with the same name left in a folder.
2. Every rank, when its script has ended, leaves ``rank{r}`` (its report, exit status, time of its crash).
3. Rank 0 leaves ``collecting`` with its deadline and waits until every rank's report is there or the deadline
   passes (``AMPDOCTOR_RANK_WAIT`` seconds, 60; 10 when rank 0 itself failed, since the others may wait on it in a
   collective; a few when the job is being stopped), merges, prints, writes the one JSON, then ``done`` naming the
   ranks it reported. A rank that sent nothing is named; one whose process is gone (on rank 0's machine) died.
4. A rank other than 0 prints nothing, except when its script failed: then rank 0 may never report (stopped by
   torchrun, or blocked in a collective on the failed rank), so it waits a few seconds for ``collecting``, then for
   ``done``, and prints its own report, labelled with its rank, unless rank 0 reported it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import replace
from typing import Any, Callable

from ampdoctor.core.report import Report, rank_spans
from ampdoctor.core.words import word_for
from ampdoctor.ranks.info import RankInfo, from_environment
from ampdoctor.ranks.mailbox import FolderMailbox, Mailbox, StoreMailbox, agent_store_address, alive, wait_until
from ampdoctor.ranks.merge import disagreements, merge_rank_reports

__all__ = ["RankExchange", "wait_seconds", "ENV_DIR", "ENV_WAIT"]

ENV_DIR = "AMPDOCTOR_RANK_DIR"
ENV_WAIT = "AMPDOCTOR_RANK_WAIT"
WAIT = 60.0          # rank 0, after its script ended normally: the others end about when it does
WAIT_FAILED = 10.0   # rank 0, after its script failed: the others may be blocked on it and never end
WAIT_STOPPED = 5.0   # rank 0, when the job is being stopped (SIGTERM): the others are sending theirs now
GRACE = 5.0          # a failed rank, for rank 0 to start collecting before it prints its own report
POLL = 0.05
SKEW = 5.0           # files older than rank 0's start (less this) belong to an earlier launch
STALE = 86_400.0     # other launches' folders untouched this long are removed by the next rank 0
# A crash that only says a peer went away: the rank that died is the one that failed first.
_PEER_GONE = re.compile(r"connection (reset|closed) by peer|broken pipe|connection refused|socket timeout|"
                        r"recvBytes|failed to recv|communicator was aborted|NCCL (error|communicator)|"
                        r"ProcessGroup\w* .*(aborted|timed out)", re.IGNORECASE)


class RankExchange:
    """One rank's side of the hand-over; see the module's description.

    Args:
        info: this process's rank; ``info.job`` names the exchange.
        folder: the folder to meet in (default: the job's c10d store under torchrun, else ``AMPDOCTOR_RANK_DIR``,
            else one in the temporary directory).
        stopped: tells whether the job is being stopped (SIGTERM): every wait ends then.
    """

    def __init__(self, info: RankInfo, folder: str | None = None, stopped: Callable[[], bool] = lambda: False) -> None:
        self.info, self.rank, self.stopped = info, info.rank, stopped
        self.started = time.time()
        self.statuses: dict[int, dict[str, Any]] = {}
        self.notes: list[str] = []   # why the exchange is not what it should be (a refused folder, no store)
        self.mailbox = self._mailbox(folder)
        # Without a shared mailbox only the ranks on rank 0's node meet; the others are named as not collected.
        local = info.local_world_size
        self.node_only = self.mailbox is not None and not self.mailbox.shared and local is not None \
            and 0 < local < info.world_size
        self.collects = self.mailbox is not None and (not self.node_only or info.node == 0)
        self._waiting = False
        self._sent: dict[str, Any] | None = None

    def _mailbox(self, folder: str | None) -> Mailbox | None:
        address = agent_store_address() if folder is None else None
        if address is not None:
            try:
                return StoreMailbox(*address, prefix=f"ampdoctor/{self.info.job}/")
            except OSError as exc:
                self.notes.append(f"{exc}; the ranks' reports go through files instead")
        shared = folder or os.environ.get(ENV_DIR)
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        path = os.path.join(shared or tempfile.gettempdir(), f"ampdoctor-{uid}-ranks-{self.info.job}")
        try:
            return FolderMailbox(path, shared=bool(shared), not_before=self.started - SKEW)
        except OSError as exc:
            self.notes.append(f"the ranks' reports cannot be handed to rank 0: {exc}")
            return None

    @classmethod
    def for_this_process(cls, stopped: Callable[[], bool] = lambda: False) -> "RankExchange | None":
        """Return the exchange of this torchrun worker, started, or ``None`` outside a launched job of several
        processes."""
        info = from_environment()
        if info is None or info.job is None:
            return None
        exchange = cls(info, stopped=stopped)
        exchange.start()
        return exchange

    @property
    def where(self) -> str:
        return "nowhere" if self.mailbox is None else self.mailbox.where

    # ---- every rank ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Note the start (``started{r}``); on rank 0, clear what an earlier launch with this name left in a folder."""
        self.started = time.time()
        if not self.collects:
            return
        if self.rank == 0 and isinstance(self.mailbox, FolderMailbox):
            self._sweep(self.mailbox)
        try:
            self.mailbox.put(f"started{self.rank}", {"pid": os.getpid(), "host": socket.gethostname(),
                                                     "time": self.started})
        except OSError:
            pass

    def _sweep(self, mailbox: FolderMailbox) -> None:
        mailbox.not_before = self.started - SKEW
        mailbox.remove(n for n in mailbox.names() if os.path.getmtime(mailbox.path(n)) < mailbox.not_before)
        parent, name = os.path.split(mailbox.folder)
        prefix = name[:name.index("-ranks-") + len("-ranks-")]
        try:   # what jobs whose rank 0 was killed left, a day or more ago (one small file each)
            for other in os.listdir(parent):
                path = os.path.join(parent, other)
                if other.startswith(prefix) and os.path.getmtime(path) < self.started - STALE:
                    shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass

    def send(self, report: Report, exit_code: int, explained: bool, failed_at: float | None) -> bool:
        """Leave this rank's report for rank 0; return False where rank 0 cannot read it (another node, no disk)."""
        if not self.collects:
            return False
        try:
            if exit_code and self.rank != 0:
                # Before the report: rank 0 keeps the folder until this rank has seen that its crash was reported.
                self.mailbox.put(f"waiting{self.rank}", {})
                self._waiting = True
            self._sent = {"rank": self.rank, "exit_code": exit_code, "explained": explained, "failed_at": failed_at,
                          "pid": os.getpid(), "printed": False, "report": report.to_dict()}
            self.mailbox.put(f"rank{self.rank}", self._sent)
        except OSError:
            self.collects = False   # a full or read-only disk, a store gone: this rank reports itself if it failed
            return False
        return True

    def reported_by_rank0(self) -> bool:
        """On a rank whose script failed: wait for rank 0 to report; return whether it reported this rank."""
        if not self.collects:
            return False
        try:
            deadline = time.time() + min(GRACE, wait_seconds())
            while not self.stopped():
                done = self.mailbox.get("done")
                if done is not None:
                    return self.rank in (done.get("ranks") or [])
                collecting = self.mailbox.get("collecting")   # rank 0 collects: wait for it a little longer
                if collecting is not None and isinstance(collecting.get("deadline"), (int, float)):
                    deadline = max(deadline, float(collecting["deadline"]) + GRACE)
                if time.time() >= deadline:
                    return False
                time.sleep(POLL)
            return False
        finally:
            if self._waiting:
                self.mailbox.remove([f"waiting{self.rank}"])

    def unreported(self, own: Report, exit_code: int, explained: bool,
                   traceback: str = "above") -> tuple[Report | None, list[str]]:
        """On a rank other than 0: return this rank's report to print itself (labelled with its rank), or ``None``
        when there is nothing to print or rank 0 reported it, and the lines to say. ``traceback``: where this rank's
        traceback is (``"above"``: printed already; ``"follows"``: a framework prints it after)."""
        if not exit_code:
            return None, []
        if self.reported_by_rank0():
            return None, [f"rank {self.rank}'s failure is in rank 0's report"]
        # rank 0 was stopped, or is blocked on this rank: nobody else will explain this crash. Say so in the report
        # first, so that a rank 0 that collects it after all does not print it a second time.
        if self._sent is not None:
            try:
                self.mailbox.put(f"rank{self.rank}", {**self._sent, "printed": True})
            except OSError:
                pass
        where = "above, unchanged" if traceback == "above" else "follows"
        lines = [f"rank {self.rank} failed with {own.exception['type']}, which is not a known mixed-precision "
                 f"failure; its traceback is {where}."] if own.exception and not explained else []
        return merge_rank_reports({self.rank: own}, expected=[self.rank]), lines

    # ---- rank 0 --------------------------------------------------------------------------------------------------
    def collect(self, own: Report, exit_code: int, explained: bool, failed_at: float | None) -> Report:
        """Wait for the other ranks' reports (up to the deadline), and return the merged report of the job."""
        world = self.info.world_size
        local = self.info.local_world_size or world
        wanted = set(range(local if self.node_only else world)) - {0}
        reports: dict[int, Report] = {0: own}
        self.statuses = {0: {"exit_code": exit_code, "explained": explained, "failed_at": failed_at}}
        notes = list(self.notes)
        if self.collects:
            wait = self.wait_for(exit_code)
            deadline = time.time() + wait
            try:
                self.mailbox.put("collecting", {"deadline": deadline, "pid": os.getpid()})
            except OSError:
                pass
            wait_until(lambda: self._arrived(wanted, reports), deadline, self.stopped)
            self._arrived(wanted, reports)   # what came in while the job was being stopped
        late = sorted(wanted - set(reports))
        died = self._died(late)
        if late:
            why = ("the job was stopped first" if self.stopped() else
                   f"none within {self.wait_for(exit_code):g} s" if self.collects else "they could not be handed over")
            running = [r for r in late if r not in died]
            if running:
                notes.append(f"no report from {word_for(len(running), 'rank')} {', '.join(map(str, running))} "
                             f"({why}): killed, crashed while writing it, or still running")
            if died:
                notes.append(f"no report from {word_for(len(died), 'rank')} {', '.join(map(str, died))}: the "
                             "process is gone (killed by a signal, or crashed without a Python exception)")
        if self.node_only:
            notes.append(f"ranks {local}-{world - 1} run on other nodes and were not collected: set {ENV_DIR} to a "
                         "folder every node can read")
        times = {r: s["failed_at"] for r, s in self.statuses.items() if isinstance(s.get("failed_at"), (int, float))}
        merged = merge_rank_reports(reports, expected=range(world), failed_at=times, notes=notes)
        ranks = merged.extra["ranks"]
        ranks["via"] = self.where
        if died:
            ranks["died"] = died
        first = self._failed_first(merged, died)
        if first is not None:
            ranks["failed_first"] = first
        for finding in disagreements(reports):  # AMP411: compared here, from the reports; no collective
            merged.add(finding)
        return merged

    def _arrived(self, wanted: set[int], reports: dict[int, Report]) -> bool:
        for rank in sorted(wanted - set(reports)):
            data = self.mailbox.get(f"rank{rank}")
            if data is None:
                continue
            try:
                reports[rank] = Report.from_dict(data["report"])
            except (KeyError, TypeError, ValueError):
                continue
            self.statuses[rank] = {k: data.get(k) for k in ("exit_code", "explained", "failed_at", "printed")}
        return wanted <= set(reports)

    def _died(self, late: list[int]) -> list[int]:
        """Return the ranks among ``late`` whose process, on this machine, is gone."""
        host = socket.gethostname()
        died = []
        for rank in late:
            started = self.mailbox.get(f"started{rank}") if self.mailbox is not None else None
            pid = (started or {}).get("pid")
            if isinstance(pid, int) and started.get("host") == host and not alive(pid):
                died.append(rank)
        return died

    def _failed_first(self, merged: Report, died: list[int]) -> int | None:
        """Return the rank that failed first: a rank that died, when every crash reported only says that a peer
        went away (or none was reported); else the first crash reported."""
        crash = merged.exception
        if died and (crash is None or all(_PEER_GONE.search(str(e.get("message", "")))
                                          for e in merged.extra["ranks"]["exceptions"])):
            return died[0]
        return int(crash["rank"]) if crash and str(crash.get("rank", "")).isdigit() else None

    def wait_for(self, exit_code: int) -> float:
        """Return how long rank 0 waits for the others, given its own script's exit status."""
        if self.stopped():
            return min(WAIT_STOPPED, wait_seconds())
        return min(WAIT_FAILED, wait_seconds()) if exit_code else wait_seconds()

    def announce(self, report: Report) -> None:
        """Tell the failed ranks their crash was reported; then clear the exchange once none of them waits."""
        if not self.collects:
            return
        failed = [r for r, s in self.statuses.items() if r != 0 and s.get("exit_code")]
        world = range(self.info.world_size)
        if failed:
            try:
                self.mailbox.put("done", {"ranks": sorted(self.statuses)})
            except OSError:
                return
            wait_until(lambda: all(self.mailbox.get(f"waiting{r}") is None for r in failed), time.time() + 3.0,
                       self.stopped)
        if isinstance(self.mailbox, FolderMailbox):
            shutil.rmtree(self.mailbox.folder, ignore_errors=True)
        else:
            self.mailbox.remove(["collecting", "done", *(f"{kind}{r}" for r in world for kind in ("rank", "started"))])

    def shown(self, report: Report) -> Report:
        """Return ``report`` for rank 0's console: without the findings only ranks that printed their own report
        (a failed rank, while rank 0 could not yet collect) have, so nothing is printed twice. The JSON has all."""
        printed = {r for r, s in self.statuses.items() if s.get("printed")}
        if not printed:
            return report
        shown = replace(report, findings=[f for f in report.findings if not set(f.ranks or ()) <= printed])
        first = (report.exception or {}).get("rank")
        if first not in (None, "0") and int(first) in printed:
            shown = replace(shown, exception=None)   # its own rank printed that crash already
        return shown

    def summary_lines(self, report: Report) -> list[str]:
        """Return what rank 0 says under the merged report: ranks not heard from, which ranks failed with what (one
        line per exception), and which failed first."""
        ranks = report.extra.get("ranks") or {}
        lines = list(ranks.get("notes", []))
        printed = sorted(r for r, s in self.statuses.items() if s.get("printed"))
        if printed:
            lines.append(f"{word_for(len(printed), 'rank')} {', '.join(map(str, printed))} printed "
                         f"{'its' if len(printed) == 1 else 'their'} own report above, before rank 0 could collect "
                         "it; it is in the JSON report too")
        first, crash = ranks.get("failed_first"), report.exception or {}
        if first is not None and first in (ranks.get("died") or []):
            after = (f"; rank {crash.get('rank')} failed after it, with {crash.get('type')}: "
                     f"{str(crash.get('message'))[:300]}" if crash else "")
            lines.append(f"rank {first} failed first: it died without a report (its process is gone){after}")
        elif str(crash.get("rank", "")).isdigit():
            crashes = ranks.get("exceptions") or []
            if crash["rank"] != "0" or len(crashes) > 1:   # rank 0's own crash alone: its traceback says it
                lines += self._failure_lines(crashes, int(crash["rank"]))
        return lines

    def _failure_lines(self, crashes: list[dict[str, Any]], first: int) -> list[str]:
        """Return one line per exception (its type and message) naming every rank that raised it, the first
        crash's first: ``ranks 0, 1 failed with ValueError: ...; rank 1 first``."""
        by_exception: dict[tuple[str, str], list[int]] = {}
        for crash in crashes:
            key = (str(crash.get("type")), str(crash.get("message"))[:300])
            by_exception.setdefault(key, []).append(int(crash["rank"]))
        lines = []
        for (kind, message), ranks in sorted(by_exception.items(), key=lambda item: first not in item[1]):
            explained = any(self.statuses.get(r, {}).get("explained") for r in ranks)
            what = f"{kind}: {message}{'' if explained else ' (not a known mixed-precision failure)'}"
            if len(ranks) == 1:
                lines.append(f"rank {ranks[0]} failed {'first' if ranks[0] == first else 'after it'}, with {what}")
            else:
                when = f"; rank {first} first" if first in ranks else ""
                lines.append(f"ranks {rank_spans(sorted(ranks))} failed {'' if when else 'after it, '}with "
                             f"{what}{when}")
        return lines


def wait_seconds() -> float:
    """Return how long rank 0 waits for the other ranks' reports (``AMPDOCTOR_RANK_WAIT``, else 60 s)."""
    try:
        return max(0.0, float(os.environ.get(ENV_WAIT, WAIT)))
    except ValueError:
        return WAIT
