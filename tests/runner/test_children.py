"""`ampdoctor run` follows the training into child processes, runs modules, and never calls "nothing" all clear."""

import json
import os
import sys

import pytest

from ampdoctor.ui.cli import main

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def script(name):
    return os.path.join(SCRIPTS, name)


def run_json(tmp_path, *argv):
    out = tmp_path / "report.json"
    code = main(["run", "--no-watch", "--json", str(out), *argv])
    return code, json.loads(out.read_text())


def amp101_names(report):
    return " ".join(f["where"] + " " + f["detail"] for f in report["findings"] if f["code"] == "AMP101")


def test_a_subprocess_launcher_is_diagnosed_like_the_script_itself(tmp_path, capsys):
    code, report = run_json(tmp_path, script("launcher_subprocess.py"))
    err = capsys.readouterr().err
    assert code == 0  # the launcher itself exits 0 after its child failed, as it does without ampdoctor
    assert "no mixed-precision problems found" not in err
    assert report["ok"] is False
    assert report["observed"] == {"models": 1, "optimizers": 1, "scalers": 1}
    child = [f for f in report["findings"] if f.get("process")]
    assert {f["code"] for f in child} >= {"AMP101"}
    assert all("seed.py" in f["process"] for f in child)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert name in amp101_names(report)
    assert report["child_exceptions"][0]["type"] == "ValueError"
    assert "core/patch.py" not in err  # the child's traceback reads as python prints it


def test_an_mp_spawn_script_is_diagnosed_in_every_worker(tmp_path, capsys):
    code, report = run_json(tmp_path, script("spawn_seed.py"))
    capsys.readouterr()
    assert code == 1
    processes = {f["process"] for f in report["findings"] if f["code"] == "AMP101" and f.get("process")}
    assert len(processes) == 2 and all("multiprocessing child" in p for p in processes)
    assert report["observed"]["models"] == 2


def test_no_children_flag_leaves_children_alone(tmp_path, capsys):
    code, report = run_json(tmp_path, "--no-children", script("launcher_subprocess.py"))
    capsys.readouterr()
    assert report["findings"] == [] and report["ok"] is False
    assert report["observed"] == {"models": 0, "optimizers": 0, "scalers": 0}


def test_a_module_runs_like_python_dash_m(tmp_path, monkeypatch, capsys):
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(open(script("seed.py")).read())
    monkeypatch.chdir(tmp_path)
    code, report = run_json(tmp_path, "-m", "trainpkg.train", "3")
    capsys.readouterr()
    assert code == 1 and report["exception"]["type"] == "ValueError"
    assert "0.weight" in amp101_names(report)
    assert sys.argv[0] != "trainpkg.train"  # argv restored


def test_a_missing_module_is_a_usage_error(capsys):
    assert main(["run", "-m", "no_such_module_xyz"]) == 2
    assert "no module named 'no_such_module_xyz'" in capsys.readouterr().err


def test_a_script_that_trains_nothing_gets_the_nothing_observed_answer(tmp_path, capsys):
    (tmp_path / "idle.py").write_text("import torch\nprint(torch.ones(2).sum().item())\n")
    code, report = run_json(tmp_path, str(tmp_path / "idle.py"))
    err = capsys.readouterr().err
    assert code == 0
    assert report["ok"] is False and "nothing was trained" in report["why_not_ok"]
    assert "nothing was trained in a process ampdoctor could see" in err
    assert "no mixed-precision problems found" not in err
