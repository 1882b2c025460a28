"""The parent side of following child processes: the start-up hook that runs a Doctor in each of them.

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
import tempfile

from ampdoctor.core.options import RunOptions
from ampdoctor.core.report import Report
from ampdoctor.ranks.children import ChildReports
from ampdoctor.ranks.info import RankInfo
from ampdoctor.ranks.mailbox import alive
from ampdoctor.runner.child import ENV_DIR, ENV_OPTIONS

STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup")
# One line: `site` executes .pth lines that start with "import". Inert (one environ lookup) without the variable.
PTH_LINE = ("import os; exec('try:\\n from ampdoctor.runner.child import install\\n install()"
            "\\nexcept Exception:\\n pass') "
            f"if os.environ.get({ENV_DIR!r}) else None\n")


class ChildProcesses:
    """Follow child Python processes while the context is open; a context manager.

    Args:
        options: the run's options, which the children's Doctors use too (the JSON report is the parent's).
    """

    def __init__(self, options: RunOptions) -> None:
        self.options = options.replace(json_path=None)
        self.directory: str | None = None
        self._saved: dict[str, str | None] = {}
        self._pth_files: list[str] = []

    def __enter__(self) -> "ChildProcesses":
        self.directory = tempfile.mkdtemp(prefix="ampdoctor-children-")
        self._pth_files = _write_pth_files()
        values = {ENV_DIR: self.directory, ENV_OPTIONS: json.dumps(self.options.to_dict())}
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
        """Return ``report`` merged with those of the child processes that are ranks of a job (see
        ``ampdoctor.ranks.children.ChildReports.merge_ranks``)."""
        return report if self.directory is None else ChildReports(self.directory).merge_ranks(report, rank)

    def merge_into(self, report: Report) -> list[str]:
        """Add each child's findings, exception and counts to ``report``; return the labels of the children that
        reported (see ``ampdoctor.ranks.children.ChildReports.merge_into``)."""
        return [] if self.directory is None else ChildReports(self.directory).merge_into(report)


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
        if pid.isdigit() and not alive(int(pid)):
            stale.append(path)
    return stale


def _remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass
