"""Hand each rank's report to rank 0 through files, so a torchrun job prints one report and writes one JSON.

Why files and not torch.distributed: when the script ends, its process group is often destroyed already; a rank
that crashed never reaches a collective; and a collective that one rank starts and another never joins hangs the
whole job, the worst harm ampdoctor could do. Files need nothing from the group. The ranks of one launch meet in
one folder, named from what torchrun gives all of them and no other launch (``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RUN_ID`` and the restart count), in the temporary directory, or in ``AMPDOCTOR_RANK_DIR`` (a
folder every node can read, for a job of several nodes).

1. Rank 0, when it starts, notes the time and removes what an earlier, killed job left in the folder.
2. Every rank, when its script has ended, writes ``rank{r}.json`` (its report, exit status, time of its crash)
   whole, by renaming a finished temporary file.
3. Rank 0 writes ``collecting.json`` with its deadline and waits until every rank's file is there or the deadline
   passes (``AMPDOCTOR_RANK_WAIT`` seconds, 60; 10 when rank 0 itself failed, since the others may wait on it in a
   collective), merges, prints, writes the one JSON, then ``done.json`` naming the ranks it reported.
4. A rank other than 0 prints nothing, except when its script failed: then rank 0 may never report (killed by
   torchrun, or blocked in a collective on the failed rank), so it waits a few seconds for ``collecting.json``,
   then for ``done.json``, and prints its own report, labelled with its rank, unless rank 0 reported it.

While they wait, a SIGTERM (torchrun stopping the job after one rank failed) ends the wait: what has arrived is
printed, then the signal is delivered again so that the process ends as it would have without ampdoctor.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any

from ampdoctor.core.ranks import RankInfo, from_environment
from ampdoctor.core.report import Report, merge_rank_reports

ENV_DIR = "AMPDOCTOR_RANK_DIR"
ENV_WAIT = "AMPDOCTOR_RANK_WAIT"
WAIT = 60.0          # rank 0, after its script ended normally: the others end about when it does
WAIT_FAILED = 10.0   # rank 0, after its script failed: the others may be blocked on it and never end
GRACE = 5.0          # a failed rank, for rank 0 to start collecting before it prints its own report
SKEW = 5.0           # files older than rank 0's start (less this) belong to an earlier launch
STALE = 86_400.0     # other launches' folders untouched this long are removed by the next rank 0
POLL = 0.05


class RankExchange:
    """One rank's side of the hand-over; see the module's description.

    Args:
        info: this process's rank; ``info.job`` names the folder.
        folder: the folder to meet in (default: ``AMPDOCTOR_RANK_DIR``, else one in the temporary directory).
    """

    def __init__(self, info: RankInfo, folder: str | None = None) -> None:
        self.info = info
        self.rank = info.rank
        shared = folder or os.environ.get(ENV_DIR)
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        self.folder = os.path.join(shared or tempfile.gettempdir(), f"ampdoctor-{uid}-ranks-{info.job}")
        # Without a shared folder only the ranks on rank 0's node meet; the others are named as not collected.
        local = info.local_world_size
        self.node_only = shared is None and local is not None and 0 < local < info.world_size
        self.collects = not self.node_only or info.node == 0
        self.started = time.time()
        self.statuses: dict[int, dict[str, Any]] = {}
        self.terminated = False
        self._previous_handler: Any = None
        self._waiting_file: str | None = None
        self._sent: dict[str, Any] | None = None

    @classmethod
    def for_this_process(cls) -> "RankExchange | None":
        """Return the exchange of this torchrun worker, started, or ``None`` outside a launched job of several
        processes."""
        info = from_environment()
        if info is None or info.job is None:
            return None
        exchange = cls(info)
        exchange.start()
        return exchange

    # ---- every rank ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Note the start; on rank 0, remove files an earlier launch with the same name left behind."""
        self.started = time.time()
        if self.rank != 0 or not self.collects:
            return
        parent, prefix = os.path.split(self.folder)
        prefix = prefix[:prefix.index("-ranks-") + len("-ranks-")]
        try:
            for name in os.listdir(self.folder):
                path = os.path.join(self.folder, name)
                if os.path.getmtime(path) < self.started - SKEW:
                    os.remove(path)
        except OSError:
            pass
        try:   # what jobs whose rank 0 was killed left, a day or more ago (one small file each)
            for name in os.listdir(parent):
                path = os.path.join(parent, name)
                if name.startswith(prefix) and os.path.getmtime(path) < self.started - STALE:
                    shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass

    def send(self, report: Report, exit_code: int, explained: bool, failed_at: float | None) -> bool:
        """Write this rank's report for rank 0; return False where rank 0 cannot read it (another node)."""
        if not self.collects:
            return False
        try:
            os.makedirs(self.folder, exist_ok=True)
            if exit_code and self.rank != 0:
                # Before the report: rank 0 keeps the folder until this rank has seen that its crash was reported.
                self._waiting_file = os.path.join(self.folder, f"waiting{self.rank}")
                open(self._waiting_file, "w").close()
            self._sent = {"rank": self.rank, "exit_code": exit_code, "explained": explained, "failed_at": failed_at,
                          "pid": os.getpid(), "printed": False, "report": report.to_dict()}
            self._write(f"rank{self.rank}.json", self._sent)
        except OSError:
            self.collects = False   # a full or read-only disk: this rank reports itself if it failed
            return False
        return True

    def reported_by_rank0(self) -> bool:
        """On a rank whose script failed: wait for rank 0 to report; return whether it reported this rank."""
        if not self.collects:
            return False
        self._catch_sigterm()
        try:
            deadline = time.time() + min(GRACE, wait_seconds())
            while not self.terminated and time.time() < deadline:
                done = self._read("done.json")
                if done is not None:
                    return self.rank in (done.get("ranks") or [])
                collecting = self._read("collecting.json")
                if collecting is not None and isinstance(collecting.get("deadline"), (int, float)):
                    deadline = max(deadline, float(collecting["deadline"]) + GRACE)
                time.sleep(POLL)
            return False
        finally:
            if self._waiting_file is not None:
                _remove(self._waiting_file)

    def unreported(self, own: Report, exit_code: int, explained: bool) -> tuple[Report | None, list[str]]:
        """On a rank other than 0: return this rank's report to print itself (labelled with its rank), or
        ``None`` when there is nothing to print or rank 0 reported it, and the lines to say."""
        if not exit_code:
            return None, []
        if self.reported_by_rank0():
            return None, [f"rank {self.rank}'s failure is in rank 0's report"]
        # rank 0 was stopped, or is blocked on this rank: nobody else will explain this crash. Say so in the file
        # first, so that a rank 0 that collects it after all does not print it a second time.
        if self._sent is not None:
            try:
                self._write(f"rank{self.rank}.json", {**self._sent, "printed": True})
            except OSError:
                pass
        lines = [f"rank {self.rank} failed with {own.exception['type']}, which is not a known mixed-precision "
                 "failure; its traceback is above, unchanged."] if own.exception and not explained else []
        return merge_rank_reports({self.rank: own}, expected=[self.rank]), lines

    # ---- rank 0 --------------------------------------------------------------------------------------------------
    def collect(self, own: Report, exit_code: int, explained: bool, failed_at: float | None) -> Report:
        """Wait for the other ranks' reports (up to the deadline), and return the merged report of the job."""
        world = self.info.world_size
        local = self.info.local_world_size or world
        wanted = set(range(local if self.node_only else world)) - {0}
        reports: dict[int, Report] = {0: own}
        self.statuses = {0: {"exit_code": exit_code, "explained": explained, "failed_at": failed_at}}
        notes: list[str] = []
        self._catch_sigterm()
        try:
            os.makedirs(self.folder, exist_ok=True)
            deadline = time.time() + (min(WAIT_FAILED, wait_seconds()) if exit_code else wait_seconds())
            self._write("collecting.json", {"deadline": deadline, "pid": os.getpid()})
            while True:
                for rank in sorted(wanted - set(reports)):
                    data = self._read(f"rank{rank}.json")
                    if data is None:
                        continue
                    try:
                        reports[rank] = Report.from_dict(data["report"])
                    except (KeyError, TypeError, ValueError):
                        continue
                    self.statuses[rank] = {k: data.get(k) for k in ("exit_code", "explained", "failed_at", "printed")}
                if wanted <= set(reports) or self.terminated or time.time() >= deadline:
                    break
                time.sleep(POLL)
        except OSError as exc:
            notes.append(f"could not read the other ranks' reports in {self.folder!r}: {exc.strerror}")
        late = sorted(wanted - set(reports))
        if late:
            why = "torchrun stopped the job first" if self.terminated else f"none within {_wait_for(exit_code):g} s"
            notes.append(f"no report from rank(s) {', '.join(map(str, late))} ({why}): killed, crashed while "
                         "writing it, or still running")
        if self.node_only:
            notes.append(f"ranks {local}-{world - 1} run on other nodes and were not collected: set {ENV_DIR} to a "
                         "folder every node can read")
        times = {r: s["failed_at"] for r, s in self.statuses.items() if isinstance(s.get("failed_at"), (int, float))}
        merged = merge_rank_reports(reports, expected=range(world), failed_at=times, notes=notes)
        for finding in disagreements(reports):  # AMP411: compared here, from the files; no collective
            merged.add(finding)
        return merged

    def announce(self, report: Report) -> None:
        """Tell the failed ranks their crash was reported; then clear the folder once none of them waits."""
        try:
            failed = [r for r, s in self.statuses.items() if r != 0 and s.get("exit_code")]
            if failed:
                self._write("done.json", {"ranks": sorted(self.statuses)})
                deadline = time.time() + 3.0
                while time.time() < deadline and any(
                        os.path.exists(os.path.join(self.folder, f"waiting{r}")) for r in failed):
                    time.sleep(POLL)
            shutil.rmtree(self.folder, ignore_errors=True)
        except OSError:
            pass

    def shown(self, report: Report) -> Report:
        """Return ``report`` for rank 0's console: without the findings only ranks that printed their own report
        (a failed rank, while rank 0 could not yet collect) have, so nothing is printed twice. The JSON has all."""
        printed = {r for r, s in self.statuses.items() if s.get("printed")}
        if not printed:
            return report
        return replace(report, findings=[f for f in report.findings if not set(f.ranks or ()) <= printed])

    def summary_lines(self, report: Report, own: Report) -> list[str]:
        """Return what rank 0 says under the merged report: ranks not heard from, and which rank failed first."""
        lines = list((report.extra.get("ranks") or {}).get("notes", []))
        printed = sorted(r for r, s in self.statuses.items() if s.get("printed"))
        if printed:
            lines.append(f"rank(s) {', '.join(map(str, printed))} printed their own report above, before rank 0 "
                         "could collect it; it is in the JSON report too")
        first = (report.exception or {}).get("rank")
        if first not in (None, "0"):
            status = self.statuses.get(int(first), {})
            known = "" if status.get("explained") else " (not a known mixed-precision failure)"
            after = f"; rank 0 failed after it, with {own.exception['type']}" if own.exception else ""
            lines.append(f"rank {first} failed first, with {report.exception.get('type')}: "
                         f"{str(report.exception.get('message'))[:300]}{known}{after}")
        return lines

    # ---- the end -------------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Put back the SIGTERM handler; if a SIGTERM came while waiting, deliver it again now."""
        if self._previous_handler is None:
            return
        previous, self._previous_handler = self._previous_handler, None
        try:
            signal.signal(signal.SIGTERM, previous)
        except (ValueError, OSError):
            return
        if self.terminated:
            for stream in (sys.stdout, sys.stderr):   # what was printed must reach the log before the signal
                try:
                    stream.flush()
                except (OSError, ValueError, AttributeError):
                    pass
            os.kill(os.getpid(), signal.SIGTERM)

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _catch_sigterm(self) -> None:
        # Only while ampdoctor waits, after the script has ended: the script's own handling is never changed.
        if self._previous_handler is not None or threading.current_thread() is not threading.main_thread():
            return
        try:
            self._previous_handler = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except (ValueError, OSError):
            self._previous_handler = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminated = True

    def _write(self, name: str, data: dict[str, Any]) -> None:
        path = os.path.join(self.folder, name)
        with open(f"{path}.{os.getpid()}.tmp", "w", encoding="utf-8") as f:
            json.dump(data, f, default=str)
        os.replace(f"{path}.{os.getpid()}.tmp", path)  # readers never see half a file

    def _read(self, name: str) -> dict[str, Any] | None:
        path = os.path.join(self.folder, name)
        try:
            if os.path.getmtime(path) < self.started - SKEW:
                return None  # an earlier launch's
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) else None


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


def wait_seconds() -> float:
    """Return how long rank 0 waits for the other ranks' reports (``AMPDOCTOR_RANK_WAIT``, else 60 s)."""
    try:
        return max(0.0, float(os.environ.get(ENV_WAIT, WAIT)))
    except ValueError:
        return WAIT


def _wait_for(exit_code: int) -> float:
    return min(WAIT_FAILED, wait_seconds()) if exit_code else wait_seconds()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def disagreements(reports: dict[int, Report]) -> list[Any]:
    """Return AMP411 when the ranks' watches recorded different skipped steps or loss scales (see
    ``ampdoctor.guard.history.rank_disagreements``); nothing when fewer than two ranks watched the scale."""
    from ampdoctor.guard.history import rank_disagreements

    per_rank = {}
    for rank, report in reports.items():
        scale = ((report.extra.get("watch") or {}).get("scale") or {})
        if isinstance(scale.get("steps"), int) and isinstance(scale.get("history"), list):
            per_rank[rank] = {"steps": scale["steps"], "skipped_steps": scale.get("skipped_steps") or [],
                              "scale_history": scale["history"]}
    return rank_disagreements(per_rank) if len(per_rank) > 1 else []
