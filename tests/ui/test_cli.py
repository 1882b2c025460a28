"""The command line: rules, explain, usage errors and the demo, tested in-process through main(argv)."""

import io
import json
import os
import re
import subprocess
import sys

import pytest

from ampdoctor.core.catalog import RULES
from ampdoctor.ui.cli import main
from ampdoctor.ui.demo import DEMO_SCRIPT

LINUX_SYS = pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's /sys, which nobody can write")


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


def test_explain_unknown_text_exits_1_and_names_at_most_the_closest_rules(capsys):
    # "unknown" is an answer, but not an explanation: `explain - < log && ...` must not read it as one (EXIT_STATUS)
    assert main(["explain", "asdfghjkl"]) == 1
    assert "no rule in the catalog explains this text" in " ".join(capsys.readouterr().out.split())
    assert main(["explain", "RuntimeError: Half and BFloat16 inputs do not match in my_custom_op"]) == 1
    assert "closest family: dtype mismatch (AMP5xx)" in " ".join(capsys.readouterr().out.split())  # wrapped at 80
    assert main(["explain", "loss is nan"]) == 1
    said = " ".join(capsys.readouterr().out.split())
    assert "closest rules: AMP613 (The loss is inf/NaN)" in said
    assert len(set(re.findall(r"AMP6\d\d", said))) <= 3   # not the family's 19 codes
    assert "lists the family's 19 rules" in said


@pytest.mark.parametrize("argv", [["AMP999"], ["amp999"], ["AMP101", "AMP998"]])
def test_explain_a_code_that_is_not_in_the_catalog_is_bad_input(argv, capsys):
    assert main(["explain", *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    bad = argv[-1]
    assert f"{bad} is not a rule code: codes run from AMP001 to AMP708" in err and "ampdoctor rules" in err


def test_explain_and_rules_write_ascii_where_the_stream_cannot_encode_more(tmp_path):
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    for argv in (["explain", "AMP104"], ["rules", "--markdown"], ["explain", "Attempting to unscale FP16 gradients"]):
        done = subprocess.run([sys.executable, "-m", "ampdoctor", *argv], capture_output=True, env=env)
        assert done.returncode == 0, done.stderr.decode()
        assert b"UnicodeEncodeError" not in done.stderr
        done.stdout.decode("ascii")   # every byte ASCII
    done = subprocess.run([sys.executable, "-m", "ampdoctor", "explain", "AMP104"], capture_output=True, env=env)
    assert b"2**-24 ~ 6e-8" in done.stdout   # the catalog's "\u2248", in ASCII


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
    # permission bits say yes as root; writing says no (and must, before the script runs, not after)
    pytest.param(["--json", "/sys/ampdoctor-report.json"], "cannot be written", marks=LINUX_SYS),
    pytest.param(["--log-dir", "/sys/ampdoctor-logs"], "cannot be created", marks=LINUX_SYS),
])
def test_bad_output_paths_and_conflicting_options_are_usage_errors_before_the_run(argv, said, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    code = main(["run", *[a.format(tmp=tmp_path) for a in argv], str(script)])
    err = " ".join(capsys.readouterr().err.split())   # wrapped at 80 columns around the temporary path
    assert code == 2 and said in err and "Traceback" not in err
    assert not marker.exists()  # the script never started


def test_report_html_to_a_bad_path_is_a_usage_error(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["run", "--no-watch", "--json", str(report), os.path.join(os.path.dirname(__file__), "..", "scripts",
                                                                            "stray.py")]) == 1
    capsys.readouterr()
    code = main(["report", str(report), "--html", str(tmp_path / "nope" / "out.html")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "does not exist" in err and "Traceback" not in err


def test_run_options_after_the_script_are_said_to_go_to_the_script_and_fixes_name_the_real_command(tmp_path,
                                                                                                   capsys):
    script = tmp_path / "finetune.py"
    script.write_text(DEMO_SCRIPT)   # crashes on 'Attempting to unscale FP16 gradients'; reads no argument
    assert main(["run", "--no-watch", str(script), "3", "--fix"]) == 1   # --fix went to the script: it crashed
    err = " ".join(capsys.readouterr().err.split())
    assert (f"ampdoctor: --fix comes after the script's name, so it goes to the script, not to ampdoctor; for "
            f"ampdoctor, put it before: ampdoctor run --fix {script} 3") in err
    # the fix says the command that was run, with --fix: not "train.py"
    fix = err[err.index("how to fix"):]
    fix = fix.replace("# ", "")   # a long path wraps onto a comment line of its own
    assert f"or run it as: ampdoctor run --fix {script} 3 by hand" in fix and "train.py" not in fix
    assert f"{script} 3 --fix" not in fix
    assert main(["run", "--no-watch", str(script), "3", "--", "--fix"]) == 1   # "--": on purpose, nothing said
    assert "comes after the script's name" not in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["folder", "json", "ranks"])
def test_report_on_a_file_with_no_record_of_ours_is_bad_input_not_an_all_clear(layout, tmp_path, capsys):
    garbage = 'hello world\n{"not": "ours"}\n'
    target = {"folder": tmp_path / "logs" / "ampdoctor.jsonl", "json": tmp_path / "r.json",
              "ranks": tmp_path / "logs" / "ampdoctor.rank0.jsonl"}[layout]
    target.parent.mkdir(exist_ok=True)
    target.write_text(garbage)
    path = str(target if layout == "json" else target.parent)
    page = tmp_path / "page.html"
    assert main(["report", path, "--strict", "--html", str(page)]) == 2
    captured = capsys.readouterr()
    said = " ".join(captured.err.split())
    assert "holds no ampdoctor record (line 1: not JSON" in said
    assert "line 2: a JSON object that is no ampdoctor record (no 'type')" in said
    assert "no mixed-precision problems found" not in captured.out + captured.err and not page.exists()


def test_a_usage_error_is_wrapped_to_80_columns_with_paths_whole(tmp_path, capsys):
    deep = tmp_path / ("a-folder-with-a-long-name-" * 3) / "and-a-long-report-name.json"
    assert main(["report", str(deep)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) > 1 and all(len(line) <= 80 or len(line.split()) == 1 for line in lines), lines
    assert any(str(deep) in line for line in lines)   # the path on one line, whole, to copy
