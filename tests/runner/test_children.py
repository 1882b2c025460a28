"""`ampdoctor run` follows the training into child processes, runs modules, and never calls "nothing" all clear."""

import json
import os
import sys

from ampdoctor.core.options import RunOptions
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


def test_mp_spawn_workers_that_are_ranks_are_one_finding_listing_the_ranks(tmp_path, monkeypatch, capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("PORT", str(sock.getsockname()[1]))
    code, report = run_json(tmp_path, script("spawn_ddp_seed.py"))
    err = capsys.readouterr().err
    assert code == 1   # mp.spawn re-raises the worker's error, as without ampdoctor
    # one AMP101 per module, seen by both ranks; not one per worker process, and not the parent's own reading of
    # the error text that mp.spawn re-raised (it named a line of the script and no parameter)
    assert [(f["code"], f["where"], f["ranks"]) for f in report["findings"]] == [
        ("AMP101", "0", [0, 1]), ("AMP101", "2", [0, 1])], report["findings"]
    assert not any(f.get("process") for f in report["findings"]) and "child_processes" not in report
    assert report["ranks"]["reported"] == [0, 1] and report["observed"]["models"] == 2
    assert "on ranks 0, 1" in err and "not a known mixed-precision failure" not in err


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


# ---- children that are the other ranks of the run's job (Lightning strategy="ddp"; the whole run is in
# tests/public: test_lightning_ddp_16_true_is_one_report_listing_both_ranks) -------------------------------------
def _rank_child(directory, pid, rank, findings=None):
    from ampdoctor.core.findings import Finding, Severity
    from ampdoctor.core.report import Report

    (directory / f"rank-{pid}.json").write_text(json.dumps({"rank": rank, "world": 2}))
    if findings is not None:
        report = Report([Finding(code, Severity.ERROR, "fc.weight", "float16") for code in findings])
        (directory / f"child-{pid}.json").write_text(json.dumps(
            {"process": f"pid {pid}: x.py", "rank": rank, "world": 2, "report": report.to_dict()}))


def _exited_child():
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.communicate()
    return proc.pid   # reaped: gone


def test_a_rank_child_is_merged_by_rank_and_a_killed_one_is_named_missing_without_a_wait(tmp_path, monkeypatch):
    import time

    from ampdoctor.core.findings import Finding, Severity
    from ampdoctor.core.report import Report
    from ampdoctor.ranks.info import RankInfo
    from ampdoctor.runner.children import ChildProcesses

    children = ChildProcesses(RunOptions())
    children.directory = str(tmp_path)
    own = Report([Finding("AMP101", Severity.ERROR, "fc.weight", "float16")], observed={"models": 1})
    _rank_child(tmp_path, _exited_child(), 1, ["AMP101"])
    merged = children.merge_ranks(own, RankInfo(0, 2))
    assert [(f.code, f.ranks, f.process) for f in merged.findings] == [("AMP101", (0, 1), None)]
    assert merged.extra["ranks"]["reported"] == [0, 1] and not list(tmp_path.glob("child-*.json"))
    # killed before it wrote its report: not waited for (it is gone), and the report is not ok
    for path in tmp_path.iterdir():
        path.unlink()
    _rank_child(tmp_path, _exited_child(), 1)
    monkeypatch.setenv("AMPDOCTOR_RANK_WAIT", "30")
    began = time.monotonic()
    merged = children.merge_ranks(own, RankInfo(0, 2))
    assert time.monotonic() - began < 5
    assert merged.missing_ranks == [1] and not merged.ok
    assert "no report from rank 1" in merged.extra["ranks"]["notes"][0]


def test_a_child_that_exited_unreaped_is_not_taken_for_running(tmp_path):
    import subprocess
    import time

    from ampdoctor.ranks.mailbox import alive as _alive

    proc = subprocess.Popen([sys.executable, "-c", "pass"])   # not waited for: a zombie once it exits
    deadline = time.monotonic() + 30
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(proc.pid) and proc.poll() == 0   # its parent still gets its exit status
    assert _alive(os.getpid())


def test_a_run_that_is_no_rank_keeps_its_own_findings_next_to_its_rank_children(tmp_path):
    from ampdoctor.core.findings import Finding, Severity
    from ampdoctor.core.report import Report
    from ampdoctor.runner.children import ChildProcesses

    children = ChildProcesses(RunOptions())
    children.directory = str(tmp_path)
    _rank_child(tmp_path, _exited_child(), 1, ["AMP101"])
    own = Report([Finding("AMP208", Severity.WARNING, "torch.autocast", "x")], observed={"models": 0})
    merged = children.merge_ranks(own, None)   # torch.multiprocessing.spawn: the parent is no rank
    assert [(f.code, f.ranks) for f in merged.findings] == [("AMP208", None), ("AMP101", (1,))]
    assert merged.missing_ranks == [0]   # rank 0, another worker, never reported
