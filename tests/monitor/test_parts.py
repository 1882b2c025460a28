"""The watch is a clock and declared parts (``monitor.part``): a part added in a file of its own reaches every view.

``scripts/toy_part.py`` declares a toy part (the largest |gradient| of each sampled step) and its summary section,
with no edit to ampdoctor, and trains under ``ampdoctor run``. Its numbers reach the console, the JSON report, the
flight recorder's step and end lines, ``ampdoctor report`` in another process (which has not loaded the part: it
reads the section as written) and the HTML page.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch_jobs import clean_environment

from ampdoctor.core.records import read_log
from ampdoctor.monitor.part import PartsAside, WatchPart
from ampdoctor.monitor.parts import parts

SCRIPT = Path(__file__).parent / "scripts" / "toy_part.py"
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _ampdoctor(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = clean_environment(COLUMNS="100", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "ampdoctor", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_part_added_in_one_file_reaches_every_view(tmp_path):
    run = _ampdoctor(tmp_path, "run", "--every", "1", "--json", "r.json", "--log-dir", "logs", str(SCRIPT), "6")
    toy = json.loads((tmp_path / "r.json").read_text())["watch"]["toy"]
    _, lines, problems = read_log(tmp_path / "logs")
    steps = [line["toy"]["max_grad"] for line in lines if line["type"] == "step" and "toy" in line]
    end = next(line for line in lines if line["type"] == "end")
    assert problems == [] and len(steps) == 6 and toy == {"looked": 6, "largest_grad": max(steps)} == \
        end["summary"]["toy"]
    shown = f"toy: looked 6, largest_grad {max(steps):.4g}"
    assert shown in run.stderr   # the console's watch summary
    report = _ampdoctor(tmp_path, "report", "logs", "--html", "page.html")   # a process without the part loaded
    assert shown in report.stdout
    page = (tmp_path / "page.html").read_text()
    assert "<td>toy</td><td>looked</td><td>6</td>" in page
    assert f"<td>toy</td><td>largest_grad</td><td>{max(steps):.4g}</td>" in page


def test_every_built_in_part_is_declared_once_with_a_name():
    names = [cls.name for cls in parts()]
    assert names == ["gradients", "scale", "lost_updates", "loss", "averages", "activations", "audit", "state"]
    assert all(issubclass(cls, WatchPart) and cls.__doc__ for cls in parts())


def test_a_part_that_raises_steps_aside_under_its_own_name_once():
    stopped: list[str] = []
    aside = PartsAside(["gradients", "scale"], step=lambda: 7, on_fail=stopped.append)
    for _ in range(3):
        aside.guard("scale", lambda: 1 / 0)
    assert aside.guard("gradients", lambda: "read") == "read"
    assert stopped == ["scale"] and [(f.code, f.where, f.step) for f in aside.findings] == [
        ("AMP001", "ampdoctor.watch (scale)", 7)]
    aside.fail("watch", RuntimeError("the step clock"))   # the whole watch takes every part with it
    assert aside.off == {"watch", "gradients", "scale"} and stopped == ["scale", "watch"]


@pytest.mark.parametrize("hook", ["attach", "set_sampling", "read_point", "pending", "consume", "check",
                                  "sections", "findings", "stop", "detach"])
def test_every_hook_of_the_protocol_is_declared_with_its_docstring(hook):
    assert getattr(WatchPart, hook).__doc__
