"""The callbacks and ``ampdoctor run`` are one lifecycle (``ampdoctor.session``): on one script they say the same.

The script (``scripts/same_as_run.py``) trains a model whose head a stray ``.half()`` left in float16, by Lightning
or by the transformers Trainer. Once under ``ampdoctor run``, once with the framework's callback: the findings and the
watch's summary (steps, sampled steps, host syncs, every gradient statistic, the lost updates) are the same. With
the callback under ``ampdoctor run`` the process still shows one report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch_jobs import clean_environment

SCRIPT = Path(__file__).parent / "scripts" / "same_as_run.py"
# How the clip is named differs by design: `ampdoctor run` sees clip_grad_norm_, the callback the Trainer's argument.
NAMED_BY_THE_FRAMEWORK = {"AMP611"}


def _run(tmp_path: Path, *command: str) -> dict:
    _stderr(tmp_path, *command)
    return json.loads((tmp_path / "r.json").read_text())


def _stderr(tmp_path: Path, *command: str) -> str:
    env = clean_environment(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run([sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]
    return done.stderr


@pytest.mark.parametrize("framework", ["lightning", "trainer"])
def test_the_callback_and_ampdoctor_run_give_the_same_findings_and_watch_summary(tmp_path, framework):
    (tmp_path / "run").mkdir()
    (tmp_path / "callback").mkdir()
    run = _run(tmp_path / "run", "-m", "ampdoctor", "run", "--json", "r.json", str(SCRIPT), framework)
    callback = _run(tmp_path / "callback", str(SCRIPT), framework, "r.json")

    def findings(report: dict) -> list[tuple[str, str, str]]:
        return [(f["code"], f["severity"], f["where"] if f["code"] not in NAMED_BY_THE_FRAMEWORK else "")
                for f in report["findings"]]

    assert findings(run) == findings(callback)
    assert {"AMP103"} <= {f["code"] for f in run["findings"]}
    watched, called = run["watch"], callback["watch"]
    for key in ("steps", "sampled_steps", "host_syncs", "every", "stats", "formats", "scale", "gradients",
                "lost_updates", "activations", "off"):
        assert watched[key] == called[key], key
    assert watched["steps"] == 12 and watched["lost_updates"]["params"]["body.head.weight"]["lost_fraction"] > 0


def test_what_the_trainers_arguments_show_is_found_both_ways(tmp_path):
    # AMP209 (bf16=True on a half head) and AMP610 (NaN losses the log hides) read the Trainer that holds the
    # Accelerator: ampdoctor run finds them as the callback does, at the same places and steps.
    (tmp_path / "run").mkdir()
    (tmp_path / "callback").mkdir()
    run = _run(tmp_path / "run", "-m", "ampdoctor", "run", "--json", "r.json", str(SCRIPT), "trainer-flags")
    callback = _run(tmp_path / "callback", str(SCRIPT), "trainer-flags", "r.json")

    def found(report: dict) -> list[tuple[str, str, int | None]]:
        return sorted((f["code"], f["where"], f["step"]) for f in report["findings"]
                      if f["code"] in ("AMP209", "AMP610"))

    assert found(run) == found(callback) == [("AMP209", "TrainingArguments(bf16=True)", None),
                                             ("AMP610", "TrainingArguments(logging_nan_inf_filter=True)", 2)]
    assert [f["code"] for f in run["findings"]] == [f["code"] for f in callback["findings"]]


@pytest.mark.parametrize("framework", ["lightning", "trainer"])
def test_the_callback_under_ampdoctor_run_leaves_one_report_on_the_console(tmp_path, framework):
    err = _stderr(tmp_path, "-m", "ampdoctor", "run", "--json", "r.json", str(SCRIPT), framework, "cb.json")
    lines = err.splitlines()
    run = json.loads((tmp_path / "r.json").read_text())
    callback = json.loads((tmp_path / "cb.json").read_text())   # the callback still writes what it was asked to
    assert lines.count("ampdoctor findings") == 1, err[-3000:]
    assert lines.count("how to fix") == 1
    assert sum(line.startswith("ampdoctor watch:") for line in lines) == 1
    amp103 = [f for f in run["findings"] if f["code"] == "AMP103"]
    assert amp103 and sum(line.startswith("AMP103 warning") for line in lines) == len(amp103)
    assert {f["code"] for f in callback["findings"]} == {f["code"] for f in run["findings"]}
