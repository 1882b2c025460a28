"""Launching the multi-process runs of the rank tests: each job in a subprocess of its own session, with a timeout.

The scripts under rank_scripts/ start process groups and train when run: the tests run them as programs; never
import them (pytest runs with --doctest-modules).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

collect_ignore_glob = ["rank_scripts/*"]

SCRIPTS = Path(__file__).parent / "rank_scripts"
TIMEOUT = 120   # the jobs take 10-30 s on two cores; a hang must fail the test, not the suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], cwd: Path, **env: str) -> tuple[int, str]:
    """Run ``command`` (a job of two processes) and return its exit status and its stdout and stderr together."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
             and not k.startswith(("TORCHELASTIC_", "AMPDOCTOR_"))}
    clean.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HOME=str(cwd / "hf"), HF_HUB_OFFLINE="1",
                 TRANSFORMERS_OFFLINE="1", **env)
    # its own session, killed as a group on timeout: the workers must not outlive a hung job
    proc = subprocess.Popen(command, cwd=cwd, env=clean, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise AssertionError(f"the job hung for {TIMEOUT} s:\n{out[-5000:]}") from None
    return proc.returncode, out


@pytest.fixture
def rank_job():
    """The launcher of the rank tests: ``rank_job(command, cwd, **env) -> (exit status, output)``."""
    return launch


@pytest.fixture
def job_port() -> int:
    """A free TCP port for the job's rendezvous; the tests look for the exchange folder named after it."""
    return free_port()
