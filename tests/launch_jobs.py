"""Running a job of several processes from a test: in a session of its own, under a timeout, never left behind.

Used by the torchrun, accelerate launch, Lightning and Trainer rank tests. A hang must fail its test, not the
suite, and no worker may outlive it: on a timeout the whole process group gets SIGTERM (torchrun passes it on to
its workers, which it starts in sessions of their own), then, 20 s later, SIGKILL.

A job whose rank died of torch's gloo teardown abort is run once more (``TEARDOWN_ABORT``). Where a
``ProcessGroupGloo`` outlives ``destroy_process_group`` (an FSDP model holds it) its worker thread may drop the last
collective's work only once the interpreter is finalizing; the work's thread-local state then takes the GIL, and
the thread's forced unwind ends in ``std::terminate``. Seen with no ampdoctor in the process (tests/public's
FSDP T5 script, plain) about once in 20 two-rank jobs on 2 loaded cores; the core dump's stack is
``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` -> ``gil_scoped_acquire`` -> ``pthread_exit`` from
``ProcessGroupGloo::runLoop``. pytorch/pytorch#179291 proposed destroying the groups at exit and was withdrawn.
A second abort fails the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import warnings
from pathlib import Path

# what a launch sets for its workers: a test's job must not inherit another job's rank or rendezvous
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# what libstdc++ prints when std::terminate is called with no exception in flight
TEARDOWN_ABORT = "terminate called without an active exception"


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


def teardown_abort(returncode: int, output: str) -> bool:
    """Whether a job (or one of its ranks) died of torch's gloo teardown abort: SIGABRT from ``std::terminate``."""
    aborted = returncode == -signal.SIGABRT or "SIGABRT" in output
    return returncode != 0 and aborted and TEARDOWN_ABORT in output


def run_job_streams(command: list[str], cwd: Path, env: dict[str, str], timeout: float,
                    merge_stderr: bool = False) -> tuple[int, str, str]:
    """Run ``command`` and return its exit status, its stdout and its stderr ("" when merged into stdout).

    A job that died of the gloo teardown abort (see the module's docstring) is run once more, with a warning that
    pytest's summary shows.
    """
    returncode, out, err = _run_once(command, cwd, env, timeout, merge_stderr)
    if teardown_abort(returncode, out + err):
        warnings.warn(f"{' '.join(command[-3:])}: a rank died of torch's gloo teardown abort; running the job again",
                      stacklevel=2)
        returncode, out, err = _run_once(command, cwd, env, timeout, merge_stderr)
    return returncode, out, err


def _run_once(command: list[str], cwd: Path, env: dict[str, str], timeout: float,
              merge_stderr: bool) -> tuple[int, str, str]:
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
