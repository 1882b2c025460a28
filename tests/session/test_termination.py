"""The end of a run on SIGTERM: the report, ``--json`` and the flight recorder's end line, then exit status 143.

A scheduler (Slurm preemption, Kubernetes, torchrun's agent) stops a job with SIGTERM. Without ampdoctor the process
ends at once; under ``ampdoctor run`` it ends the same way, after the run's report was printed and written.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from ampdoctor.core.records import read_log

SCRIPT = Path(__file__).parent / "scripts" / "slow_fp16_sgd.py"


def _run_until_stopped(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "ampdoctor", "run", "--json", "r.json", "--log-dir", "logs",
                             str(SCRIPT), *args], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "training\n"   # four steps done: pre-flight ran, the watch sampled
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out, err


def test_sigterm_while_the_script_trains_ends_the_run_with_its_report_and_status_143(tmp_path: Path) -> None:
    code, out, err = _run_until_stopped(tmp_path)
    assert code == -signal.SIGTERM, err[-3000:]   # killed by SIGTERM, as without ampdoctor: the shell says 143
    report = json.loads((tmp_path / "r.json").read_text())
    assert "AMP103" in [f["code"] for f in report["findings"]]   # what pre-flight found is not lost
    assert report["ok"] is False and report["exit_status"] == 143
    assert report["why_not_ok"].startswith("the run was stopped by SIGTERM after ")
    lines = err.splitlines()
    assert any(line.startswith("AMP103 ") for line in lines), err[-3000:]
    assert "ampdoctor: report written to r.json" in lines
    assert "ampdoctor: the run was stopped by SIGTERM after " in " ".join(err.split())
    header, records, problems = read_log(tmp_path / "logs")
    assert [r["type"] for r in records][-2:] == ["end", "report"] and problems == []


def test_a_scripts_own_sigterm_handler_is_left_alone(tmp_path: Path) -> None:
    code, out, err = _run_until_stopped(tmp_path, "own-handler")
    assert code == 0, err[-3000:]   # the script's handler ended its loop; the run ended normally
    assert "stopped by the script's own handler" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert "exit_status" not in report and "terminated" not in report
    assert "AMP103" in [f["code"] for f in report["findings"]]
