"""The parent side of following child processes: set up the start-up hook, then merge what the children found.

The mechanism is the one coverage.py uses for subprocess measurement: a start-up hook enabled by an environment
variable. Like coverage, a temporary ``ampdoctor-child-<pid>.pth`` goes into every writable site-packages directory
(it also runs under ``python -I``, and shadows nothing) and is removed when the run ends; it is inert without the
variable. Where no site-packages is writable, a folder holding a ``sitecustomize.py`` goes first on ``PYTHONPATH``
instead (it chains to the ``sitecustomize`` it shadows). Every child Python process that inherits the environment,
started by ``subprocess`` with ``sys.executable`` or by ``multiprocessing``/``torch.multiprocessing`` (spawn or
forkserver), then runs a Doctor of its own (see `ampdoctor.runner.child`). Forked children already carry the
parent's Doctor.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time
from dataclasses import replace
from typing import Any

from ampdoctor.core.ranks import RankInfo
from ampdoctor.core.report import Report, merge_rank_reports
from ampdoctor.runner.child import ENV_DIR, ENV_OPTIONS
from ampdoctor.runner.rank_reports import POLL, disagreements, wait_seconds

STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup")
# One line: `site` executes .pth lines that start with "import". Inert (one environ lookup) without the variable.
PTH_LINE = (f"import os; exec('try:\\n from ampdoctor.runner.child import install\\n install()\\nexcept Exception:\\n pass') "
            f"if os.environ.get({ENV_DIR!r}) else None\n")


class ChildProcesses:
    """Follow child Python processes while the context is open; a context manager.

    Args:
        options: the Doctor options the children use (``fix``, ``watch``, ``every``, ``log_dir``,
            ``activations``), JSON-ready.
    """

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.directory: str | None = None
        self._saved: dict[str, str | None] = {}
        self._pth_files: list[str] = []

    def __enter__(self) -> "ChildProcesses":
        self.directory = tempfile.mkdtemp(prefix="ampdoctor-children-")
        self._pth_files = _write_pth_files()
        values = {ENV_DIR: self.directory, ENV_OPTIONS: json.dumps(self.options)}
        if not self._pth_files:
            pythonpath = os.environ.get("PYTHONPATH")
            values["PYTHONPATH"] = STARTUP_DIR + (os.pathsep + pythonpath if pythonpath else "")
        for key, value in values.items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        return self

    def __exit__(self, *exc: object) -> None:
        _remove(self._pth_files)
        self._pth_files = []
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def merge_ranks(self, report: Report, rank: RankInfo | None) -> Report:
        """Return ``report`` merged with those of the child processes that are ranks of a distributed job, as
        ``ampdoctor run`` merges ranks under torchrun: one finding per problem, listing the ranks that saw it.
        Lightning's ``strategy="ddp"`` starts them so (this process is rank 0 and re-runs the script once per other
        rank), and so does ``torch.multiprocessing.spawn`` of workers that each join a process group (this process
        is no rank: its own findings stay its own).

        A child marks itself a rank when its Doctor first reads its process group. The other ranks may end after
        this process's script has: wait for each marked child to leave its report or exit (up to
        ``AMPDOCTOR_RANK_WAIT`` seconds, 60). Their files are removed; other children are left to ``merge_into``.
        """
        if self.directory is None:
            return report
        marked = {}
        for path in glob.glob(os.path.join(self.directory, "rank-*.json")):
            data = _read(path)
            pid = os.path.basename(path)[len("rank-"):-len(".json")]
            if data is not None and pid.isdigit() and isinstance(data.get("rank"), int) and isinstance(
                    data.get("world"), int) and (rank is None or data["rank"] != rank.rank):
                marked[int(pid)] = (data["rank"], data["world"])
        if not marked:
            return report
        deadline = time.time() + wait_seconds()
        while time.time() < deadline and any(not os.path.exists(self._report_path(pid)) and _alive(pid)
                                             for pid in marked):
            time.sleep(POLL)
        reports: dict[int, Report] = {rank.rank: report} if rank is not None else {}
        failed_at: dict[int, float] = {}
        for pid, (other, _) in marked.items():
            data = _read(self._report_path(pid))
            try:
                reports[other] = Report.from_dict(data["report"])   # type: ignore[index]
            except (KeyError, TypeError, ValueError):
                continue   # killed before it wrote: named as missing
            if isinstance(data.get("failed_at"), (int, float)):
                failed_at[other] = data["failed_at"]
            _remove([self._report_path(pid)])
        late = sorted({r for r, _ in marked.values()} - set(reports))
        notes = [f"no report from rank(s) {', '.join(map(str, late))} within {wait_seconds():g} s: killed, crashed "
                 "while writing it, or still running"] if late else []
        world = rank.world_size if rank is not None else max(w for _, w in marked.values())
        merged = merge_rank_reports(reports, expected=range(world), failed_at=failed_at, notes=notes)
        for finding in disagreements(reports):   # AMP411, from the reports: no collective
            merged.add(finding)
        return merged if rank is not None else _with_parent(merged, report)

    def _report_path(self, pid: int) -> str:
        return os.path.join(self.directory or "", f"child-{pid}.json")

    def merge_into(self, report: Report) -> list[str]:
        """Add each child's findings (labelled with its process), exception and counts to ``report``.

        Returns the labels of the children that reported. The children's files are removed.
        """
        labels: list[str] = []
        if self.directory is None:
            return labels
        for path in sorted(glob.glob(os.path.join(self.directory, "child-*.json")), key=os.path.getmtime):
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
                child = Report.from_dict(data["report"])
                process = str(data["process"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a child killed while writing: its console output stands
            labels.append(process)
            for finding in child.findings:
                report.add(replace(finding, process=process))
            if child.exception is not None:
                report.extra.setdefault("child_exceptions", []).append({"process": process, **child.exception})
            if child.observed:
                total = dict(report.observed or {})
                for kind, count in child.observed.items():
                    total[kind] = total.get(kind, 0) + count
                report.observed = total
            report.changes.extend(f"[{process}] {c}" for c in child.changes)
        shutil.rmtree(self.directory, ignore_errors=True)
        if labels:
            report.extra["child_processes"] = labels
        return labels


def _write_pth_files() -> list[str]:
    """Write the start-up hook into every writable site-packages directory; return the files written."""
    import atexit
    import site

    written = []
    for directory in dict.fromkeys(site.getsitepackages() + [site.getusersitepackages()]):
        path = os.path.join(directory, f"ampdoctor-child-{os.getpid()}.pth")
        try:
            if not os.path.isdir(directory):
                continue
            _remove(_stale(directory))
            with open(path, "w", encoding="utf-8") as f:
                f.write(PTH_LINE)
            written.append(path)
        except OSError:
            continue  # read-only site-packages: the PYTHONPATH fallback takes over if none is writable
    if written:
        atexit.register(_remove, list(written))  # the parent killed mid-run still cleans up at exit
    return written


def _stale(directory: str) -> list[str]:
    """Return hook files left by runs that were killed (SIGKILL skips atexit); they are inert, but clutter."""
    stale = []
    for path in glob.glob(os.path.join(directory, "ampdoctor-child-*.pth")):
        pid = os.path.basename(path)[len("ampdoctor-child-"):-len(".pth")]
        if pid.isdigit() and not _alive(int(pid)):
            stale.append(path)
    return stale


def _with_parent(ranks: Report, parent: Report) -> Report:
    """Return the ranks' merged report with what the parent, no rank itself, saw and did added to it."""
    merged = replace(ranks, findings=list(parent.findings), environment=parent.environment,
                     exception=parent.exception, changes=[*parent.changes, *ranks.changes],
                     extra={**parent.extra, **ranks.extra})
    for finding in ranks.findings:
        merged.add(finding)
    if parent.observed is not None:
        merged.observed = {k: parent.observed.get(k, 0) + (ranks.observed or {}).get(k, 0)
                           for k in {*parent.observed, *(ranks.observed or {})}}
    return merged


def _alive(pid: int) -> bool:
    """Return whether process ``pid`` is running: not gone, and not a zombie its parent has yet to reap."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    try:   # Linux: a child that exited but was not reaped (Lightning's launcher does not wait) is state Z
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[:1] != ["Z"]
    except OSError:
        return True


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass
