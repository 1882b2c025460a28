"""Running a job of several processes from a test: in a session of its own, under a timeout, never left behind.

Used by the torchrun, accelerate launch, Lightning and Trainer rank tests. A hang must fail its test, not the
suite, and no worker may outlive it: on a timeout the whole process group gets SIGTERM (torchrun passes it on to
its workers, which it starts in sessions of their own), then, 20 s later, SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

# what a launch sets for its workers: a test's job must not inherit another job's rank or rendezvous
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_environment(**extra: str) -> dict[str, str]:
    """Return this process's environment without launch, torchelastic and ampdoctor variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARIABLES and not k.startswith(("TORCHELASTIC_", "AMPDOCTOR_"))}
    env.update(extra)
    return env


def run_job(command: list[str], cwd: Path, env: dict[str, str], timeout: float,
            merge_stderr: bool = False) -> tuple[int, str]:
    """Run ``command`` and return its exit status and its output (stdout, then stderr; or both as they came)."""
    returncode, out, err = run_job_streams(command, cwd, env, timeout, merge_stderr)
    return returncode, out + err


def run_job_streams(command: list[str], cwd: Path, env: dict[str, str], timeout: float,
                    merge_stderr: bool = False) -> tuple[int, str, str]:
    """Run ``command`` and return its exit status, its stdout and its stderr ("" when merged into stdout)."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"the job hung for {timeout} s:\n{out[-3000:]}\n{(err or '')[-3000:]}") from None
    return proc.returncode, out, err or ""


def free_port() -> int:
    """A free TCP port on this machine, for a job's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
