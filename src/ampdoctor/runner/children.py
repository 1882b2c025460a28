"""The parent side of following child processes: set up the start-up hook, then merge what the children found.

The mechanism is the one coverage.py uses for subprocess measurement: a folder holding a ``sitecustomize.py`` goes
first on ``PYTHONPATH`` and an environment variable switches it on. Every child Python process that inherits the
environment, started by ``subprocess`` with ``sys.executable`` or by ``multiprocessing``/``torch.multiprocessing``
(spawn or forkserver), then runs a Doctor of its own (see `ampdoctor.runner.child`). Forked children already carry
the parent's Doctor.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from dataclasses import replace
from typing import Any

from ampdoctor.core.report import Report
from ampdoctor.runner.child import ENV_DIR, ENV_OPTIONS

STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup")


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

    def __enter__(self) -> "ChildProcesses":
        self.directory = tempfile.mkdtemp(prefix="ampdoctor-children-")
        pythonpath = os.environ.get("PYTHONPATH")
        values = {ENV_DIR: self.directory, ENV_OPTIONS: json.dumps(self.options),
                  "PYTHONPATH": STARTUP_DIR + (os.pathsep + pythonpath if pythonpath else "")}
        for key, value in values.items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        return self

    def __exit__(self, *exc: object) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

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
