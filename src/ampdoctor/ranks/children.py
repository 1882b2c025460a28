"""The reports of the child Python processes of ``ampdoctor run``, merged into the parent's.

Each child runs a Doctor of its own (``ampdoctor.runner.child``) and leaves, in the parent's private folder
(``AMPDOCTOR_CHILD_DIR``, a `ranks.mailbox.FolderMailbox`), ``rank-<pid>`` when it turns out to be a rank of a job
the parent launched (its Doctor read a process group) and ``child-<pid>`` with its report when it ends. Children that
are ranks are merged as torchrun's ranks are (one finding per problem, listing the ranks, AMP411); the others are
added with their process named.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace

from ampdoctor.core.report import Report
from ampdoctor.core.words import word_for
from ampdoctor.ranks.exchange import wait_seconds
from ampdoctor.ranks.info import RankInfo
from ampdoctor.ranks.mailbox import FolderMailbox, alive, wait_until
from ampdoctor.ranks.merge import disagreements, merge_rank_reports, merge_reports, with_parent

__all__ = ["ChildReports", "rank_name", "report_name", "write_child"]


def rank_name(pid: int) -> str:
    """Return the name a child that is a rank leaves when it reads its process group."""
    return f"rank-{pid}.json"


def report_name(pid: int) -> str:
    """Return the name of the report a child leaves when it ends."""
    return f"child-{pid}.json"


class ChildReports:
    """What the children left in ``folder``.

    Args:
        folder: the parent's private folder (``ChildProcesses.directory``).
    """

    def __init__(self, folder: str) -> None:
        self.mailbox = FolderMailbox(folder)

    def merge_ranks(self, report: Report, rank: RankInfo | None) -> Report:
        """Return ``report`` merged with those of the child processes that are ranks of a distributed job, as
        ``ampdoctor run`` merges ranks under torchrun: one finding per problem, listing the ranks that saw it.
        Lightning's ``strategy="ddp"`` starts them so (this process is rank 0 and re-runs the script once per other
        rank), and so does ``torch.multiprocessing.spawn`` of workers that each join a process group (this process
        is no rank: its own findings stay its own).

        The other ranks may end after this process's script has: wait for each child marked a rank to leave its
        report or exit (up to ``AMPDOCTOR_RANK_WAIT`` seconds, 60). Their reports are removed; the other children's
        are left to `merge_into`.
        """
        marked = self._ranks(rank)
        if not marked:
            return report
        wait_until(lambda: all(self.mailbox.get(report_name(pid)) is not None or not alive(pid) for pid in marked),
                   time.time() + wait_seconds())
        reports: dict[int, Report] = {rank.rank: report} if rank is not None else {}
        failed_at: dict[int, float] = {}
        for pid, (other, _) in marked.items():
            data = self.mailbox.get(report_name(pid)) or {}
            try:
                reports[other] = Report.from_dict(data["report"])
            except (KeyError, TypeError, ValueError):
                continue   # killed before it wrote: named as missing
            if isinstance(data.get("failed_at"), (int, float)):
                failed_at[other] = data["failed_at"]
            self.mailbox.remove([report_name(pid)])
        late = sorted({r for r, _ in marked.values()} - set(reports))
        notes = [f"no report from {word_for(len(late), 'rank')} {', '.join(map(str, late))} within "
                 f"{wait_seconds():g} s: killed, crashed while writing it, or still running"] if late else []
        world = rank.world_size if rank is not None else max(w for _, w in marked.values())
        merged = merge_rank_reports(reports, expected=range(world), failed_at=failed_at, notes=notes)
        for finding in disagreements(reports):   # AMP411, from the reports: no collective
            merged.add(finding)
        return merged if rank is not None else with_parent(merged, report)

    def _ranks(self, rank: RankInfo | None) -> dict[int, tuple[int, int]]:
        """Return ``{pid: (rank, world size)}`` of the children that are ranks (other than this process's rank)."""
        marked = {}
        for name in self.mailbox.names("rank-"):
            data, pid = self.mailbox.get(name), name[len("rank-"):-len(".json")]
            if data is not None and pid.isdigit() and isinstance(data.get("rank"), int) and isinstance(
                    data.get("world"), int) and (rank is None or data["rank"] != rank.rank):
                marked[int(pid)] = (data["rank"], data["world"])
        return marked

    def merge_into(self, report: Report) -> list[str]:
        """Add each child's findings (labelled with its process), exception and counts to ``report``.

        Returns the labels of the children that reported. The folder is removed.
        """
        labels: list[str] = []
        children: list[Report] = []
        for name in self.mailbox.names("child-"):
            data = self.mailbox.get(name) or {}
            try:
                child = Report.from_dict(data["report"])
                process = str(data["process"])
            except (ValueError, KeyError, TypeError):
                continue  # a child killed while writing: its console output stands
            labels.append(process)
            children.append(_labelled(child, process))
            if child.exception is not None:
                report.extra.setdefault("child_exceptions", []).append({"process": process, **child.exception})
        shutil.rmtree(self.mailbox.folder, ignore_errors=True)
        if labels:
            merged = merge_reports([report, *children], main=0)
            report.findings, report.changes, report.observed = merged.findings, merged.changes, merged.observed
            report.extra["child_processes"] = labels
        return labels


def _labelled(child: Report, process: str) -> Report:
    """Return what the parent's report takes of a child's: its findings and changes, each with its process, and its
    counts (its crash goes to the parent's ``extra["child_exceptions"]``: it is not the parent's)."""
    return Report([replace(f, process=process) for f in child.findings], changes=[f"[{process}] {c}" for c in
                  child.changes], observed=child.observed or None)


def write_child(folder: str, name: str, data: dict) -> None:
    """Leave ``data`` under ``name`` in the parent's folder (the child side); whole, as the parent reads it."""
    FolderMailbox(folder).put(name, data)

