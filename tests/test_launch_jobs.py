"""The test launcher's one retry: only torch's gloo teardown abort is run again, and only once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from launch_jobs import TEARDOWN_ABORT, run_job_streams

# prints what libstdc++ prints on std::terminate, then dies of SIGABRT, while the marker file has fewer than N lines
ABORTS_N_TIMES = f"""
import os, sys
marker = sys.argv[1]
with open(marker, "a+") as f:
    f.seek(0)
    runs = len(f.readlines())
    f.write("run\\n")
print("trained", flush=True)
if runs < int(sys.argv[2]):
    print({TEARDOWN_ABORT!r}, file=sys.stderr, flush=True)
    os.abort()
"""


def job(tmp_path: Path, aborts: int, program: str = ABORTS_N_TIMES) -> tuple[int, str, str, int]:
    marker = tmp_path / "runs"
    code, out, err = run_job_streams([sys.executable, "-c", program, str(marker), str(aborts)], tmp_path, {}, 60)
    return code, out, err, len(marker.read_text().splitlines())


def test_a_job_that_died_of_the_teardown_abort_once_is_run_again(tmp_path) -> None:
    with pytest.warns(UserWarning, match="gloo teardown abort; running the job again"):
        code, out, err, runs = job(tmp_path, aborts=1)
    assert (code, out, err, runs) == (0, "trained\n", "", 2)


def test_a_second_teardown_abort_fails(tmp_path) -> None:
    with pytest.warns(UserWarning, match="gloo teardown abort"):
        code, _, err, runs = job(tmp_path, aborts=2)
    assert (code, runs) == (-6, 2) and TEARDOWN_ABORT in err


def test_any_other_failure_is_not_run_again(tmp_path) -> None:
    plain_abort = ABORTS_N_TIMES.replace(f"print({TEARDOWN_ABORT!r}, file=sys.stderr, flush=True)", "pass")
    code, _, _, runs = job(tmp_path, aborts=1, program=plain_abort)
    assert (code, runs) == (-6, 1)
