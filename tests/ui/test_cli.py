"""The command line: rules, explain, usage errors and the demo, tested in-process through main(argv)."""

import io
import json
import os

import pytest

from ampdoctor.core.catalog import RULES
from ampdoctor.ui.cli import main


def test_rules_lists_every_code(capsys):
    assert main(["rules"]) == 0
    out = capsys.readouterr().out
    assert all(rule.code in out for rule in RULES)


def test_rules_select_by_prefix(capsys):
    assert main(["rules", "--markdown", "--select", "AMP4"]) == 0
    out = capsys.readouterr().out
    assert "AMP401" in out and "AMP101" not in out
    assert main(["rules", "--select", "XYZ"]) == 2


def test_explain_error_text(capsys):
    assert main(["explain", "ValueError: Attempting to unscale FP16 gradients."]) == 0
    out = capsys.readouterr().out
    assert "AMP101" in out and "upcast_trainable_params_" in out


def test_explain_rule_code_and_stdin(capsys, monkeypatch):
    assert main(["explain", "AMP404"]) == 0
    assert "step-twice" in capsys.readouterr().out
    tb = "Traceback (most recent call last):\n  ...\nAssertionError: No inf checks were recorded for this optimizer.\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(tb.encode())))
    assert main(["explain", "-"]) == 0
    assert "AMP406" in capsys.readouterr().out


def test_explain_unknown_text_is_answered_and_exits_0(capsys):
    # It used to exit 1: explain is a lookup, and "unknown" is an answer (EXIT_STATUS); 2 stays for bad input.
    assert main(["explain", "everything is fine"]) == 0
    assert "no rule in the catalog explains this text" in " ".join(capsys.readouterr().out.split())
    assert main(["explain", "RuntimeError: Half and BFloat16 inputs do not match in my_custom_op"]) == 0
    assert "closest family: dtype mismatch (AMP5xx)" in " ".join(capsys.readouterr().out.split())  # wrapped at 80


def test_one_exit_status_rule_for_run_and_report_and_strict_fails_on_errors(tmp_path, capsys):
    # A 10-step fp16 run whose forward overflows: every step skipped, the loss NaN, error findings; the script
    # itself exits 0. It used to exit 0 from `run`, 1 from `report r.json` and 0 from `report ampdoctor.jsonl`.
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "short_overflow.py")
    report, logs = tmp_path / "r.json", tmp_path / "logs"
    assert main(["run", "--json", str(report), "--log-dir", str(logs), script]) == 0  # the script's status
    assert "error" in {f["severity"] for f in json.loads(report.read_text())["findings"]}
    assert main(["run", "--strict", script]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "--strict: exit 1: 3 findings at error severity (AMP603, AMP601, AMP612)" in err
    log = logs / "ampdoctor.jsonl"
    assert [main(["report", str(report)]), main(["report", str(log)])] == [0, 0]
    assert [main(["report", "--strict", str(report)]), main(["report", "--strict", str(log)])] == [1, 1]
    # the log with the JSON report of the same run, as a page and as PNG figures
    html, pngs = tmp_path / "r.html", tmp_path / "figures"
    assert main(["report", str(log), "--with-report", str(report), "--html", str(html), "--png", str(pngs)]) == 0
    assert "1.wo (Linear)" in html.read_text() and sorted(p.suffix for p in pngs.iterdir())[:1] == [".png"]
    exits = os.path.join(os.path.dirname(__file__), "..", "scripts", "exit_status.py")
    assert main(["run", "--strict", exits, "0"]) == 0  # a clean fp32 run passes --strict
    assert main(["run", "--strict", exits, "3"]) == 3  # the script's own failure status is passed on


def test_help_states_the_exit_status_rule(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "exit status:" in out and "--strict" in out and "2  ampdoctor could not do what was asked" in out
    assert max(map(len, out.splitlines())) <= 80  # the help fits 80 columns


def test_usage_errors_exit_2(capsys):
    assert main(["frobnicate"]) == 2
    assert main(["run"]) == 2
    assert main(["run", "--every", "0", __file__]) == 2
    assert main([]) == 2
    assert main(["explain", "  "]) == 2


def test_demo_reproduces_diagnoses_and_repairs(capsys):
    assert main(["demo"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    # the crash: its traceback on stderr, as python prints it, and not repeated by the report
    lines = (captured.err + out).splitlines()
    assert [line for line in lines if line.startswith("ValueError:")] == [
        "ValueError: Attempting to unscale FP16 gradients."]
    assert "AMP101" in out and "0.weight" in out
    assert "ampdoctor --fix resolved AMP101 (2 places), AMP104 (1 place)" in out   # findings by code, not a count
    assert "trained to the end" in out


# ---- output paths are checked before the script starts ----------------------------------------------------------
@pytest.mark.parametrize("argv, said", [
    (["--json", "{tmp}/missing/report.json"], "does not exist"),
    (["--json", "{tmp}"], "is a folder"),
    (["--log-dir", "{tmp}/afile"], "is a file, not a folder"),
    (["--no-watch", "--log-dir", "{tmp}/logs"], "--no-watch turns the watch off"),
    (["--no-watch", "--activations"], "--no-watch turns the watch off"),
])
def test_bad_output_paths_and_conflicting_options_are_usage_errors_before_the_run(argv, said, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    code = main(["run", *[a.format(tmp=tmp_path) for a in argv], str(script)])
    err = capsys.readouterr().err
    assert code == 2 and said in err and "Traceback" not in err
    assert not marker.exists()  # the script never started


def test_report_html_to_a_bad_path_is_a_usage_error(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["run", "--no-watch", "--json", str(report), os.path.join(os.path.dirname(__file__), "..", "scripts",
                                                                            "stray.py")]) == 1
    capsys.readouterr()
    code = main(["report", str(report), "--html", str(tmp_path / "nope" / "out.html")])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and "Traceback" not in err
