"""How a run asks for the numerics audit: ``--audit``, ``--audit-steps STEPS``, ``--no-audit``, ``AMPDOCTOR=...``
and ``attach(audit=...)``; bad values exit 2 before the script starts, and the JSON says which steps were audited."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampdoctor.runner.startup import options_from_environment
from ampdoctor.ui.cli import main

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "short_overflow.py"


@pytest.mark.parametrize("argv, words", [
    (["--audit", "--no-audit"], "--no-audit turns the audit off"),
    (["--audit-steps", "soon"], "--audit-steps takes all, auto, off or step numbers such as 0,5, got 'soon'"),
    (["--no-watch", "--audit"], "--no-watch turns the watch off, but --audit needs it"),
])
def test_contradicting_or_bad_audit_options_exit_2_before_the_script(argv, words, capsys, tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    assert main(["run", *argv, str(script)]) == 2
    assert words in " ".join(capsys.readouterr().err.split()) and not marker.exists()


@pytest.mark.parametrize("argv, steps", [([], None), (["--audit"], [0, 1]), (["--audit-steps", "3"], [3]),
                                         (["--no-audit"], None),
                                         (["--audit-every"], list(range(10)))])   # the 10 steps of the dense start
def test_the_report_says_which_steps_were_audited(argv, steps, tmp_path):
    report = tmp_path / "r.json"
    assert main(["run", "--json", str(report), *argv, str(SCRIPT)]) == 0
    audit = json.loads(report.read_text())["watch"].get("audit")
    assert (audit is None) if steps is None else audit["steps"] == steps


def test_the_environment_takes_run_s_audit_options():
    assert options_from_environment("--audit-steps 0,3") == {"audit": "0,3"}
    assert options_from_environment("--no-audit --fix") == {"audit": "off", "fix": True}
    assert options_from_environment("--audit") == {"audit": "auto"}
    assert options_from_environment("--audit-every") == {"audit": "all"}
