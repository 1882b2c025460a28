"""Launching the multi-process runs of the rank tests: each job in a subprocess of its own session, with a timeout.

The scripts under rank_scripts/ start process groups and train when run: the tests run them as programs; never
import them (pytest runs with --doctest-modules).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_jobs import clean_environment, free_port, run_job

collect_ignore_glob = ["rank_scripts/*", "scripts/*"]   # the nearest conftest's list is the one that counts

SCRIPTS = Path(__file__).parent / "rank_scripts"
TIMEOUT = 120   # the jobs take 10-30 s on two cores; a hang must fail the test, not the suite


def launch(command: list[str], cwd: Path, **env: str) -> tuple[int, str]:
    """Run ``command`` (a job of two processes) and return its exit status and its stdout and stderr together."""
    clean = clean_environment(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HOME=str(cwd / "hf"),
                              HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env)
    return run_job(command, cwd, clean, TIMEOUT, merge_stderr=True)


@pytest.fixture
def rank_job():
    """The launcher of the rank tests: ``rank_job(command, cwd, **env) -> (exit status, output)``."""
    return launch


@pytest.fixture
def job_port() -> int:
    """A free TCP port for the job's rendezvous; the tests look for the exchange folder named after it."""
    return free_port()
